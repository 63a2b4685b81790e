"""How much does `Monitor.check` add to a training step? The demo model's step (nanscan.demo) timed with and
without the check, interleaved in one run, reported as median step times and one ratio line:

    monitor_overhead = 4.6% of step (median over adjacent block pairs)
    spike_detection_overhead = 0.3% of a checked step (spikes="warn" vs spikes=None, adjacent blocks)
    post_update_overhead = 0.1% of a checked step (the default, dated updates, vs post_update=False, ...)
    post_update_step_cost = +0.05% of a plain step (the hook's stamps inside optimizer.step(), medians)
    post_update_net_cost = +0.1% of a plain step (check() + optimizer.step(), with vs without, medians)
    post_update_scan_overhead = 3.6% of a checked step (post_update='scan' vs False, adjacent blocks)
    post_update_scan_net_cost = +2.83% of a plain step (check() + optimizer.step(), with vs without, medians)

More variants run in the same rotation, each its own Monitor on the same model with its own step counter, and are
reported as ratio lines against the default Monitor's adjacent blocks: `nospikes` (spikes=None, so the second line
above is the cost of spike detection, on by default), `noupdate` (post_update=False: the third to fifth lines are
the cost of the default post-update check on this float32 model, dated updates, nanscan.runtime.update NOTE:
[dated updates]; the fourth is the difference of the median optimizer.step() times, which hold the whole of its
hook, the fifth adds check()), `scan` (post_update="scan", the default for float16/bfloat16 parameters, NOTE:
[post-update check]: the last two lines) and, with TensorBoard export (on
by default; --no-tensorboard leaves it out), the Monitor with `tensorboard=<tmp dir>` at log_every=100 and at log_every=1:

    tensorboard_overhead(log_every=100) = +0.4% of the Monitor's step (median over rounds)
    tensorboard_check_cost(log_every=100) = +0.45% of a plain step (the export's time inside check(), medians)

The second is the sharper measure: the export runs only inside check() (its writer has no thread of its own), so
the difference of the median check times is its whole cost, without the step's noise.

`--reps 1 --block 2 --warmup 2` is a dry run of a few seconds that exercises every path.

Run it alone: `flock /tmp/nanscan-bench.lock .venv/bin/python benchmarks/bench_overhead.py --json
benchmarks/results/bench_overhead.json`. Steps run in blocks whose order alternates (plain, checked, checked,
plain, ...) so drift in machine load falls on both sides alike; plain steps run with the Monitor attached but not
called (its forward pre-hook returns at once). The headline is the median over block pairs of (checked block's
median step / adjacent plain block's): on a shared machine the plain step alone moves between 9 and 17 ms within
a run, which swung the ratio of the pooled medians (also reported) from 1% to 10% between runs, while the paired
ratio and the check's own time stayed within about a point at 20 block pairs (60, the default, narrow that
further; about 15 s). The check is validated (finite, every parameter, gradient and optimizer state tensor
scanned) before anything is timed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanscan import backend_info
from nanscan import demo as D
from nanscan.runtime import monitor as monitor_module
from nanscan._atomic import write_results_json
from nanscan.bench_scan import cpu_model
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.rollback import Rollback
from nanscan.runtime.window import Window

MODES = ("plain", "check")
# Variants compared with the default Monitor ("check"): the Monitor options each adds.
SPIKE_MODES = {"nospikes": {"spikes": None}, "noupdate": {"post_update": False}, "scan": {"post_update": "scan"},
               # on_invalid=Rollback (NOTE: [rollback]): on healthy steps it should cost nothing beyond the window
               "rollback": {"on_invalid": Rollback()}}
# The run's window (nanscan.runtime.window NOTE: [run window]): the default keeps one; off, and a larger one
WINDOW_MODES = {"nowindow": {"window": None}, "bigwindow": {"window": Window(steps=64, every=4)}}
TB_MODES = {"tb100": 100, "tb1": 1}  # the Monitor with TensorBoard export, by log_every


def healthy_batches(config: dict, count: int) -> list[dict[str, torch.Tensor]]:
    """Batches of the demo's data without the corrupted record, built in memory."""
    records = D.make_records(config)
    tokens = torch.tensor([r["tokens"] for r in records], dtype=torch.int64)
    weights = torch.tensor([r["weights"] for r in records], dtype=torch.float32)
    size = config["batch_size"]
    out = []
    for i in range(count):
        rows = torch.arange(i * size, (i + 1) * size) % len(records)
        out.append({"tokens": tokens[rows], "weights": weights[rows], "index": rows})
    return out


class Trainer:
    """The demo's training step; `monitor` is None for the plain variant."""

    def __init__(self, config: dict, monitor_kwargs: dict, bundle_dir: Path, tensorboard: bool = False):
        self.config = config
        with D.seeded_rngs(config["seed"]):
            self.model = D.build_model(config)
        self.optimizer = D.build_optimizer(self.model, config)
        # the defaults: post_update="auto" dates the float32 demo's updates (NOTE: [dated updates])
        self.monitor = Monitor(self.model, self.optimizer, bundle_dir=bundle_dir, config=config,
                               run_id="bench-overhead", on_invalid="raise", **monitor_kwargs)
        # variant -> the Monitor it checks with; the TensorBoard ones count their own steps (log_every applies)
        self.monitors = {"check": self.monitor}
        variants = {**SPIKE_MODES, **WINDOW_MODES}
        if tensorboard:
            variants.update({v: {"tensorboard": bundle_dir / v, "log_every": every} for v, every in TB_MODES.items()})
        for variant, options in variants.items():
            self.monitors[variant] = Monitor(self.model, self.optimizer, bundle_dir=bundle_dir, config=config,
                                             run_id=f"bench-overhead-{variant}",
                                             **{"on_invalid": "raise", **options}, **monitor_kwargs)
        self.steps = dict.fromkeys(self.monitors, 0)
        # The window's work, timed where it runs, per Monitor: its state copies at a step's start (the forward
        # pre-hook, begin), its stage inside check() (keep) and, of the loop's observation (nanscan.runtime.
        # loop_effects NOTE: [observed loop]), the gradient sample taken inside keep (arm) and the update factor
        # taken by the optimizer's step pre-hook (update, inside optimizer.step()); spread over the Monitor's checks.
        self.window_seconds = {v: dict.fromkeys(("begin", "keep", "arm", "update"), 0.0) for v in self.monitors}
        for variant, monitor in self.monitors.items():
            if monitor._window is not None:
                for part in ("begin", "keep"):
                    setattr(monitor._window, part, self._window_timed(variant, part, getattr(monitor._window, part)))
                probe = monitor._window.update_factors  # before its hook is registered, at the first check
                probe.arm = self._window_timed(variant, "arm", probe.arm)
                probe._on_update = self._window_timed(variant, "update", probe._on_update)
        self.step = 0
        self.check_seconds: dict[str, list[float]] = {variant: [] for variant in self.monitors}
        self.update_seconds: dict[str, list[float]] = {variant: [] for variant in self.monitors}
        # The default check's scan inside it, timed where it runs: what remains of check() is the work around the
        # scan. On the CPU's native backend that is one call (ModelScanPlan.scan_on_host: the plan's confirmation,
        # the scan and the step summary it also returns, NOTE: [step summary] in csrc/plan/plan_check.cpp); where
        # scan_on_host declines (the numba backend), the inputs' collection and launch() that scan instead.
        self.scan_seconds: list[float] = []
        self._scan_time: float | None = None  # the default check's scan time so far, while it runs
        plan = self.monitor._plan
        plan.scan_on_host = self._timed(plan.scan_on_host)
        plan.inputs = self._timed(plan.inputs)
        monitor_module.launch = self._timed(monitor_module.launch)

    def _window_timed(self, variant: str, part: str, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.window_seconds[variant][part] += time.perf_counter() - start
        return timed

    def _timed(self, call):
        """`call`, its time added to the running check's scan time (other checks' calls are not timed)."""
        def timed(*args, **kwargs):
            if self._scan_time is None:
                return call(*args, **kwargs)
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._scan_time += time.perf_counter() - start
        return timed

    def train_step(self, batch: dict, checked: bool | str):
        """One step; checked: False (plain), True (the default Monitor) or a variant (SPIKE_MODES, TB_MODES)."""
        variant = "check" if checked is True else checked
        self.optimizer.zero_grad(set_to_none=True)
        loss = D.step_fn(self.model, batch)
        loss.backward()
        report = None
        if variant:
            if variant == "check":
                self._scan_time = 0.0
            start = time.perf_counter()
            report = self.monitors[variant].check(batch=batch, loss=loss, lr=self.config["lr"],
                                                  step=self.steps[variant])
            if variant == "check":
                self.scan_seconds.append(self._scan_time)
                self._scan_time = None
            self.steps[variant] += 1
            self.check_seconds[variant].append(time.perf_counter() - start)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config["grad_clip"])
        start = time.perf_counter()
        self.optimizer.step()  # the Monitor that checked stamps (the default) or scans ("scan") after it
        if variant:
            self.update_seconds[variant].append(time.perf_counter() - start)
        self.step += 1
        return loss, report


def validate(trainer: Trainer, batch: dict) -> int:
    """One checked step must scan every parameter, gradient and optimizer state tensor and find them finite."""
    trainer.train_step(batch, checked=False)  # creates the optimizer state, so the next check sees it
    loss, report = trainer.train_step(batch, checked=True)
    params = list(trainer.model.parameters())
    state = sum(1 for p in params for v in trainer.optimizer.state[p].values()
                if isinstance(v, torch.Tensor) and v.is_floating_point())
    names = report.names
    counts = {prefix: sum(n.startswith(prefix) for n in names) for prefix in ("param:", "grad:", "optim:")}
    if counts != {"param:": len(params), "grad:": len(params), "optim:": state}:
        raise SystemExit(f"validation failed: the check scanned {counts}, expected {len(params)} parameters and "
                         f"gradients and {state} optimizer state tensors")
    if not report.ok or not torch.isfinite(loss):
        raise SystemExit(f"validation failed: a healthy step reported non-finite values: {report.nonfinite}")
    watch = trainer.monitor._updates
    if watch is None or watch.updates_dated != 1 or trainer.monitors["noupdate"]._updates is not None:
        raise SystemExit("validation failed: the default Monitor did not stamp the update after its checked step "
                         "once (or the post_update=False one did)")
    trainer.train_step(batch, checked="scan")
    if trainer.monitors["scan"]._updates.updates_checked != 1:
        raise SystemExit("validation failed: the post_update='scan' Monitor did not scan after its checked step")
    if "loss" not in names or not any(n.startswith("input:") for n in names):
        raise SystemExit(f"validation failed: the check did not scan the loss and the batch ({names[:5]}...)")
    return len(names)


def run(reps: int, block: int, warmup: int, snapshot: str, history: int, profile: int, width: int = 1,
        tensorboard: bool = True, d_model: int | None = None) -> dict:
    load_before = os.getloadavg()[0]  # other processes on a shared machine inflate both variants' times
    config = dict(D.DEFAULT_CONFIG)
    config["d_model"] = (d_model or config["d_model"]) * width  # --d-model, --width: the same model, resized
    batches = healthy_batches(config, 64)
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-") as tmp:
        trainer = Trainer(config, {"history": history, "snapshot": snapshot}, Path(tmp), tensorboard=tensorboard)
        scanned = validate(trainer, batches[0])
        modes = (*MODES, *SPIKE_MODES, *WINDOW_MODES, *(TB_MODES if tensorboard else ()))
        for i in range(warmup):
            mode = modes[i % len(modes)]
            trainer.train_step(batches[i % len(batches)], checked=mode != "plain" and mode)
        for seconds in [*trainer.check_seconds.values(), *trainer.update_seconds.values(), trainer.scan_seconds]:
            seconds.clear()
        trainer.window_seconds = {v: dict.fromkeys(parts, 0.0) for v, parts in trainer.window_seconds.items()}
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        pair_ratios = []  # per repetition: median checked step / median plain step of its two adjacent blocks
        # per variant: median step / the default Monitor's in the same round
        variant_ratios: dict[str, list[float]] = {v: [] for v in modes if v not in MODES}
        n = 0
        for rep in range(reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            block_medians = {}
            for mode in order:
                block_times = []
                for _ in range(block):
                    batch = batches[n % len(batches)]
                    n += 1
                    start = time.perf_counter()
                    trainer.train_step(batch, checked=mode != "plain" and mode)
                    block_times.append(time.perf_counter() - start)
                times[mode] += block_times
                block_medians[mode] = statistics.median(block_times)
            pair_ratios.append(block_medians["check"] / block_medians["plain"])
            for variant, ratios in variant_ratios.items():
                ratios.append(block_medians[variant] / block_medians["check"])
        if trainer.monitor.spikes or trainer.monitors["nospikes"].spikes:
            raise SystemExit(f"validation failed: a healthy benchmark run reported spikes: {trainer.monitor.spikes[:1]}")
        profile_text = _profile(trainer, batches, profile) if profile else None
    plain, checked = statistics.median(times["plain"]), statistics.median(times["check"])
    check_alone = statistics.median(trainer.check_seconds["check"])
    return {
        "question": "Monitor.check overhead on the nanscan demo model's training step",
        "config": {k: config[k] for k in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "batch_size")},
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "tensors_scanned_per_check": scanned,
        "monitor": {"history": history, "snapshot": snapshot},
        "reps": reps, "block": block, "warmup": warmup,
        "median_step_ms": {"plain": plain * 1e3, "check": checked * 1e3},
        "median_step_ms_all": {m: statistics.median(times[m]) * 1e3 for m in modes},
        "p10_step_ms": {m: _quantile(times[m], 0.1) * 1e3 for m in modes},
        "p90_step_ms": {m: _quantile(times[m], 0.9) * 1e3 for m in modes},
        # per log_every: the Monitor with TensorBoard export vs the plain Monitor, median over rounds
        "tensorboard_overhead_pct": {str(TB_MODES[v]): 100.0 * (statistics.median(r) - 1.0)
                                     for v, r in variant_ratios.items() if v in TB_MODES},
        # per log_every: the export's own time inside check() (it writes nowhere else: no writer thread), the
        # median check with export minus the median check without, against a plain step; less noisy than steps
        "tensorboard_check_cost_pct": {str(TB_MODES[v]): 100.0 * (statistics.median(trainer.check_seconds[v])
                                                                  - check_alone) / plain
                                       for v in TB_MODES if tensorboard},
        "median_check_nospikes_ms": statistics.median(trainer.check_seconds["nospikes"]) * 1e3,
        # on_invalid=Rollback() against "raise", both with the default window: steps (adjacent blocks) and check()
        "rollback_overhead_pct": 100.0 * (statistics.median(variant_ratios["rollback"]) - 1.0),
        "rollback_check_cost_pct": 100.0 * (statistics.median(trainer.check_seconds["rollback"]) - check_alone)
                                   / plain,
        # the default check (spikes="warn") against spikes=None, median over rounds
        "spike_detection_overhead_pct": 100.0 * (1.0 / statistics.median(variant_ratios["nospikes"]) - 1.0),
        # the default Monitor (post_update="auto": dated updates) against post_update=False: steps, and
        # optimizer.step() alone (the hook's stamps)
        "post_update_overhead_pct": 100.0 * (1.0 / statistics.median(variant_ratios["noupdate"]) - 1.0),
        "post_update_step_cost_pct": 100.0 * (statistics.median(trainer.update_seconds["check"])
                                              - statistics.median(trainer.update_seconds["noupdate"])) / plain,
        "median_update_ms": {v: statistics.median(trainer.update_seconds[v]) * 1e3
                             for v in ("check", "noupdate", "scan")},
        # check() + optimizer.step() with the post-update check against without it: what it adds in all
        "post_update_net_cost_pct": 100.0 * (_step_and_check(trainer, "check") - _step_and_check(trainer, "noupdate"))
                                    / plain,
        # the same for post_update="scan" (a scan inside optimizer.step(), its records carried to the next check)
        "post_update_scan_overhead_pct": 100.0 * (statistics.median(variant_ratios["scan"])
                                                  / statistics.median(variant_ratios["noupdate"]) - 1.0),
        "post_update_scan_net_cost_pct": 100.0 * (_step_and_check(trainer, "scan")
                                                  - _step_and_check(trainer, "noupdate")) / plain,
        # the window's cost per step: what it adds inside check() (median check against window=None) plus its
        # state copies at the steps' starts, spread over the Monitor's checks; as shares of a plain step
        "window_cost_pct": {v: _window_cost(trainer, v, plain) for v in ("check", "bigwindow")},
        "window": {v: {"steps": m._window.window.steps, "every": m._window.window.every,
                       "states": m._window.window.states, "state_bytes": sum(k.snapshot.nbytes()
                                                                             for k in m._window._states)}
                   for v, m in trainer.monitors.items() if v in ("check", "bigwindow")},
        "window_overhead_pct": 100.0 * (1.0 / statistics.median(variant_ratios["nowindow"]) - 1.0),
        "median_check_ms": check_alone * 1e3,
        # the default check split: its scan (in place, see Trainer) and the rest, as shares of a plain step
        "median_scan_in_check_ms": statistics.median(trainer.scan_seconds) * 1e3,
        "scan_share_pct": 100.0 * statistics.median(trainer.scan_seconds) / plain,
        "around_scan_share_pct": 100.0 * (check_alone - statistics.median(trainer.scan_seconds)) / plain,
        "monitor_overhead_pct": 100.0 * (statistics.median(pair_ratios) - 1.0),  # adjacent block pairs
        "pooled_overhead_pct": 100.0 * (checked - plain) / plain,
        "check_share_pct": 100.0 * check_alone / plain,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": {"start": load_before, "end": os.getloadavg()[0], "cpus": os.cpu_count()},
        "backend": backend_info()["active"].get("cpu"),
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "cpu": cpu_model(), "profile": profile_text,
    }


def _window_cost(trainer: Trainer, variant: str, plain: float) -> dict:
    """The window's time per check of a Monitor (its stage inside check(), its state copies at the steps' starts),
    timed where it runs, as shares of a plain step; and the check's median against window=None's."""
    checks = len(trainer.check_seconds[variant])
    seconds = trainer.window_seconds[variant]
    in_check, states = seconds["keep"] / checks, seconds["begin"] / checks
    at_update = seconds["update"] / checks  # the update factor's pre-hook, inside optimizer.step()
    median_diff = statistics.median(trainer.check_seconds[variant]) - statistics.median(
        trainer.check_seconds["nowindow"])
    return {"in_check": 100.0 * in_check / plain, "state_copies": 100.0 * states / plain,
            "at_update": 100.0 * at_update / plain, "total": 100.0 * (in_check + states + at_update) / plain,
            "check_median_diff": 100.0 * median_diff / plain,
            "loop_observation": 100.0 * (seconds["arm"] / checks + at_update) / plain,
            "loop_observation_us": 1e6 * (seconds["arm"] / checks + at_update)}


def _step_and_check(trainer: Trainer, variant: str) -> float:
    """Median check() time plus median optimizer.step() time of a variant, in seconds."""
    return statistics.median(trainer.check_seconds[variant]) + statistics.median(trainer.update_seconds[variant])


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _profile(trainer: Trainer, batches: list, checks: int) -> str:
    """Where the time of `checks` Monitor.check calls goes (cProfile, cumulative, top entries)."""
    batch = batches[0]
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = D.step_fn(trainer.model, batch)
    loss.backward()
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(checks):
        trainer.monitor.check(batch=batch, loss=loss, lr=trainer.config["lr"], step=trainer.step + i)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=60, help="alternating block pairs (default 60)")
    parser.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--snapshot", choices=("none", "cpu"), default="none",
                        help="Monitor snapshot mode (the demo uses cpu; default none)")
    parser.add_argument("--history", type=int, default=64, help="Monitor history length (default 64)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N checks with cProfile and print where the time goes")
    parser.add_argument("--d-model", type=int, default=None,
                        help="the demo transformer's width (default the demo's 64: 135k parameters; 44: 72k)")
    parser.add_argument("--width", type=int, default=1,
                        help="multiply the demo model's d_model by this (default 1: the demo model itself)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, as `nanscan demo` runs this model; 0 keeps torch's default)")
    parser.add_argument("--no-tensorboard", action="store_true",
                        help="leave out the Monitor with TensorBoard export (log_every=100 and 1)")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    result = run(args.reps, args.block, args.warmup, args.snapshot, args.history, args.profile, args.width,
                 tensorboard=not args.no_tensorboard, d_model=args.d_model)
    p10, p90 = result["p10_step_ms"], result["p90_step_ms"]
    print(f"demo model: {result['parameters']:,} parameters, {result['tensors_scanned_per_check']} tensors scanned "
          f"per check, backend {result['backend']}, {result['torch_threads']} torch threads")
    print(f"monitor: history={args.history}, snapshot={args.snapshot}; {args.reps} x 2 blocks of {args.block} steps; "
          f"load average {result['load_average_1min']['start']:.1f} -> {result['load_average_1min']['end']:.1f} "
          f"on {result['load_average_1min']['cpus']} CPUs")
    print(f"{'variant':<10}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}")
    for mode in result["median_step_ms_all"]:
        print(f"{mode:<10}{result['median_step_ms_all'][mode]:>12.3f}{p10[mode]:>10.3f}{p90[mode]:>10.3f}")
    print(f"check alone: median {result['median_check_ms']:.3f} ms = {result['check_share_pct']:.1f}% of a plain step")
    print(f"check_share = {result['check_share_pct']:.2f}% of a plain step: scan {result['scan_share_pct']:.2f}% "
          f"({result['median_scan_in_check_ms']:.3f} ms), around the scan {result['around_scan_share_pct']:.2f}%")
    print(f"pooled medians: checked/plain = {result['pooled_overhead_pct']:+.1f}% (sensitive to load drift)")
    print(f"check alone without spike detection: median {result['median_check_nospikes_ms']:.3f} ms")
    print(f"monitor_overhead = {result['monitor_overhead_pct']:.1f}% of step (median over adjacent block pairs)")
    print(f"rollback_overhead = {result['rollback_overhead_pct']:+.1f}% of a checked step (on_invalid=Rollback() vs "
          f"'raise', adjacent blocks); rollback_check_cost = {result['rollback_check_cost_pct']:+.2f}% of a plain "
          "step (medians of check())")
    print(f"spike_detection_overhead = {result['spike_detection_overhead_pct']:.1f}% of a checked step "
          "(spikes='warn' vs spikes=None, adjacent blocks)")
    print(f"post_update_overhead = {result['post_update_overhead_pct']:.1f}% of a checked step "
          "(the default, dated updates, vs post_update=False, adjacent blocks)")
    print(f"post_update_step_cost = {result['post_update_step_cost_pct']:+.2f}% of a plain step (the hook's "
          f"stamps inside optimizer.step(), medians: {result['median_update_ms']['check']:.3f} vs "
          f"{result['median_update_ms']['noupdate']:.3f} ms)")
    print(f"post_update_net_cost = {result['post_update_net_cost_pct']:+.2f}% of a plain step (check() + "
          "optimizer.step() with dated updates vs without, medians)")
    print(f"post_update_scan_overhead = {result['post_update_scan_overhead_pct']:.1f}% of a checked step "
          "(post_update='scan' vs False, adjacent blocks)")
    print(f"post_update_scan_net_cost = {result['post_update_scan_net_cost_pct']:+.2f}% of a plain step (check() + "
          f"optimizer.step() with the scan vs without, medians; optimizer.step() "
          f"{result['median_update_ms']['scan']:.3f} ms)")
    for variant, cost in result["window_cost_pct"].items():
        window = result["window"][variant]
        print(f"window_cost(steps={window['steps']}, every={window['every']}) = {cost['total']:.2f}% of a plain step "
              f"(its stage in check() {cost['in_check']:.2f}%, state copies at step starts {cost['state_copies']:.2f}%,"
              f" the update factor at optimizer.step() {cost['at_update']:.3f}%;"
              f" {window['states']} states of {window['state_bytes'] / max(window['states'], 1) / 1024:.0f} KiB; "
              f"median check vs window=None {cost['check_median_diff']:+.2f}%)")
    for variant, cost in result["window_cost_pct"].items():
        print(f"loop_observation({variant}) = {cost['loop_observation']:.3f}% of a plain step "
              f"({cost['loop_observation_us']:.1f} us a step: the gradient sample at the check and the update factor "
              "at optimizer.step(), NOTE: [observed loop]; inside window_cost)")
    print(f"window_overhead = {result['window_overhead_pct']:.1f}% of a checked step (the default window vs "
          "window=None, adjacent blocks)")
    for every, pct in result["tensorboard_overhead_pct"].items():
        print(f"tensorboard_overhead(log_every={every}) = {pct:+.1f}% of the Monitor's step (median over rounds)")
    for every, pct in result["tensorboard_check_cost_pct"].items():
        print(f"tensorboard_check_cost(log_every={every}) = {pct:+.2f}% of a plain step (the export's time inside "
              "check(), medians)")
    if result["profile"]:
        print(result["profile"])
    if args.json:
        print(f"wrote {write_results_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
