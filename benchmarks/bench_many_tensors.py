"""What does a scan of many small tensors cost? The tensor set Monitor.check scans every step on the nanscan demo
model (parameters, gradients after one backward, AdamW state), and the same model with d_model x4, timed with
nanscan's CPU kernel called directly (nanscan._C.scan_cpu on prebuilt pointer/size/dtype arrays, 1 thread and the
automatic thread count) against torch._foreach_norm (torch's fused multi-tensor reduction) and a
torch.isfinite(t).all() loop. Prints a table, the kernel's fixed cost per tensor and ratio lines such as

    demo/foreach_norm = 1.8x

(baseline time / nanscan time: above 1 means nanscan is faster; `@1thread` lines with nanscan on one thread).
Run it alone:

    flock /tmp/nanscan-bench.lock .venv/bin/python benchmarks/bench_many_tensors.py \
        --json benchmarks/results/bench_many_tensors.json

Before anything is timed the kernel's records are compared with the reference scan on every tensor of every set.
Each repetition runs every method once, in a new random order, so drift in machine load falls on all of them alike;
each reports its median. The kernel is timed alone: its records are reset to the identity state outside the timed
call. The fixed cost per tensor is a set's time over its tensor count, on the sets that are nearly all fixed cost
(256 one-element tensors; the demo's tensors under 1000 elements), the Python call included.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan import demo as D
from nanscan._atomic import write_results_json
from nanscan.engine.backends.reference import scan_one

try:
    from nanscan import _C
except ImportError as exc:
    raise SystemExit(f"nanscan._C does not import ({exc}); build it with "
                     "`.venv/bin/pip install -q --no-build-isolation --no-deps -e .`") from None

CODES = {torch.float16: L.FLOAT16, torch.bfloat16: L.BFLOAT16, torch.float32: L.FLOAT32, torch.float64: L.FLOAT64}
# Tensors below this many elements count as "small" in the fixed-cost line (the demo's biases, norms, Adam steps).
SMALL_ELEMS = 1000
# One-element tensors in the set that isolates the per-tensor cost (an AdamW `step` tensor is one).
SINGLES = 256


def training_tensors(d_model: int) -> dict[str, torch.Tensor]:
    """Parameters, gradients and AdamW state of the demo model with this width after one training step, and the
    gradients of a second backward: what Monitor.check scans each step."""
    config = dict(D.DEFAULT_CONFIG, d_model=d_model)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
        optimizer = D.build_optimizer(model, config)
        tokens = torch.randint(0, config["vocab_size"], (config["batch_size"], config["seq_len"] + 1))
        weights = torch.rand(config["batch_size"], config["seq_len"])
        for _ in range(2):  # the first step creates the optimizer state, the second backward leaves gradients
            optimizer.zero_grad(set_to_none=True)
            D.step_fn(model, {"tokens": tokens, "weights": weights}).backward()
            if not optimizer.state:
                optimizer.step()
    named: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        named[f"param:{name}"] = p.detach()
        named[f"grad:{name}"] = p.grad
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                named[f"optim:{name}.{key}"] = value
    return named


@dataclass
class KernelInputs:
    """The pointer/size/dtype arrays scan_cpu takes, built once, and a record array reset before each call."""

    tensors: list[torch.Tensor]
    ptrs: np.ndarray
    numels: np.ndarray
    dtypes: np.ndarray
    records: np.ndarray

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "KernelInputs":
        for t in tensors:
            if not t.is_contiguous() or t.dtype not in CODES:
                raise ValueError(f"the benchmark scans contiguous floating tensors, got {t.dtype} {tuple(t.shape)}")
        return cls(tensors, np.array([t.data_ptr() for t in tensors], dtype=np.int64),
                   np.array([t.numel() for t in tensors], dtype=np.int64),
                   np.array([CODES[t.dtype] for t in tensors], dtype=np.int32), L.empty_records(len(tensors)))

    def reset(self) -> None:
        self.records[:] = 0
        self.records[:, L.REC_ABSMIN_BITS] = L.ABSMIN_NONE

    def scan(self, num_threads: int) -> None:
        _C.scan_cpu(self.ptrs, self.numels, self.dtypes, self.records, L.DEFAULT_CHUNK_ELEMS, num_threads)


def validate(name: str, kernel: KernelInputs, labels: list[str]) -> list[str]:
    """Problems found comparing the kernel's records (1 thread and automatic) with the reference scan: every count,
    extreme and histogram bin equal, the sum of squares equal to 1e-12 (it is summed in another order)."""
    expected = np.stack([scan_one(t.reshape(-1), CODES[t.dtype]) if t.numel() else L.empty_records(1)[0]
                         for t in kernel.tensors])
    exact = np.array([k for k in range(L.RECORD_WIDTH) if k != L.REC_SUMSQ])
    problems = []
    for threads in (1, 0):
        kernel.reset()
        kernel.scan(threads)
        got = kernel.records
        for i, label in enumerate(labels):
            differ = exact[got[i, exact] != expected[i, exact]]
            if len(differ):
                problems.append(f"{name}, {threads or 'auto'} threads: {label}: record slots "
                                f"{differ[:8].tolist()} differ from the reference")
            s_got = got[i, L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0]
            s_ref = expected[i, L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0]
            if not math.isclose(s_got, s_ref, rel_tol=1e-12, abs_tol=0.0):
                problems.append(f"{name}: {label}: sum of squares {s_got!r} != reference {s_ref!r}")
    return problems


def isfinite_loop(tensors: list[torch.Tensor]) -> bool:
    ok = True
    for t in tensors:
        ok &= bool(torch.isfinite(t).all())
    return ok


@dataclass
class Method:
    name: str
    run: Callable[[], object]
    before: Callable[[], None] = lambda: None  # untimed preparation of each run


def methods_for(kernel: KernelInputs) -> list[Method]:
    tensors = kernel.tensors
    return [
        Method("nanscan 1 thread", lambda: kernel.scan(1), kernel.reset),
        Method("nanscan auto threads", lambda: kernel.scan(0), kernel.reset),
        Method("foreach_norm", lambda: torch._foreach_norm(tensors)),
        Method("isfinite loop", lambda: isfinite_loop(tensors)),
    ]


def time_methods(methods: list[Method], reps: int) -> dict[str, float]:
    """Median seconds per run of each method; each runs a few times untimed first (caches, thread pools)."""
    for m in methods:
        for _ in range(3):
            m.before()
            m.run()
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    order = random.Random(0)
    for _ in range(reps):
        # A new order each time: no method always runs right after the same other one, whose traces in the caches,
        # the branch predictors and the thread pools it would inherit.
        for m in order.sample(methods, len(methods)):
            m.before()
            start = time.perf_counter()
            m.run()
            times[m.name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def describe(tensors: list[torch.Tensor]) -> dict:
    sizes = [t.numel() for t in tensors]
    return {"tensors": len(sizes), "elements": int(sum(sizes)), "bytes": int(sum(t.nbytes for t in tensors)),
            "small_tensors": sum(s < SMALL_ELEMS for s in sizes),
            "small_elements": int(sum(s for s in sizes if s < SMALL_ELEMS)),
            "one_element_tensors": sum(s == 1 for s in sizes)}


def run(reps: int) -> dict:
    sets: dict[str, list[torch.Tensor]] = {}
    labels: dict[str, list[str]] = {}
    for name, width in (("demo", D.DEFAULT_CONFIG["d_model"]), ("demo_x4", 4 * D.DEFAULT_CONFIG["d_model"])):
        named = training_tensors(width)
        sets[name], labels[name] = list(named.values()), list(named)
    # The small tensors of the demo set alone, and many one-element tensors: what a tensor costs beyond its bytes.
    small = [i for i, t in enumerate(sets["demo"]) if t.numel() < SMALL_ELEMS]
    sets["demo_small"] = [sets["demo"][i] for i in small]
    labels["demo_small"] = [labels["demo"][i] for i in small]
    sets["singles"] = [torch.full((1,), float(i + 1)) for i in range(SINGLES)]
    labels["singles"] = [f"single{i}" for i in range(SINGLES)]

    kernels = {name: KernelInputs.of(tensors) for name, tensors in sets.items()}
    problems = [p for name, k in kernels.items() for p in validate(name, k, labels[name])]
    if problems:
        raise SystemExit("validation failed:\n" + "\n".join(problems[:20]))

    results = {}
    for name, kernel in kernels.items():
        results[name] = {**describe(kernel.tensors),
                         "median_us": {m: s * 1e6 for m, s in time_methods(methods_for(kernel), reps).items()}}
    return {
        "question": "cost of a scan of many small tensors (the demo model's Monitor.check set) with nanscan's CPU "
                    "kernel, against torch._foreach_norm and a torch.isfinite loop",
        "sets": results,
        "reps": reps,
        "chunk_elems": L.DEFAULT_CHUNK_ELEMS,
        "torch_threads": torch.get_num_threads(),
        "kernel_max_threads": _C.build_info()["max_threads"],
        "cpu_simd": _C.build_info()["cpu_simd"],
        "load_average_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
    }


def ratio_lines(result: dict) -> dict[str, float]:
    """Baseline time / nanscan time per set: above 1 means nanscan is faster. Plain keys compare with nanscan on
    its automatic thread count (torch also runs on its own), `@1thread` keys with nanscan on one thread."""
    ratios = {}
    for name in ("demo", "demo_x4"):
        times = result["sets"][name]["median_us"]
        for baseline in ("foreach_norm", "isfinite loop"):
            key = f"{name}/{baseline.replace(' ', '_')}"
            ratios[key] = times[baseline] / times["nanscan auto threads"]
            ratios[f"{key}@1thread"] = times[baseline] / times["nanscan 1 thread"]
    return ratios


def fixed_costs(result: dict) -> dict[str, float]:
    """Microseconds per tensor of the sets that are nearly all fixed cost, per method."""
    out = {}
    for name in ("singles", "demo_small"):
        entry = result["sets"][name]
        for method, us in entry["median_us"].items():
            out[f"{name}/{method}"] = us / entry["tensors"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300, help="timed runs of each method per set (default 300)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads (default 0: torch's default). torch and the kernel share one OpenMP "
                             "runtime, so this also caps the kernel's automatic thread count")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    result = run(args.reps)
    result["ratios"] = ratio_lines(result)
    result["fixed_cost_us_per_tensor"] = fixed_costs(result)
    print(f"kernel {result['cpu_simd']}, up to {result['kernel_max_threads']} threads; torch "
          f"{result['torch_threads']} threads; {args.reps} runs each; load average {result['load_average_1min']:.1f} "
          f"on {result['cpus']} CPUs; validated against the reference on every tensor")
    methods = list(next(iter(result["sets"].values()))["median_us"])
    print(f"{'set':<12}{'tensors':>8}{'elements':>10}{'small':>7}" + "".join(f"{m:>22}" for m in methods))
    for name, entry in result["sets"].items():
        print(f"{name:<12}{entry['tensors']:>8}{entry['elements']:>10}{entry['small_tensors']:>7}"
              + "".join(f"{entry['median_us'][m]:>19.1f} us" for m in methods))
    for key, us in result["fixed_cost_us_per_tensor"].items():
        print(f"fixed cost {key} = {us:.3f} us/tensor")
    for key, value in result["ratios"].items():
        print(f"{key} = {value:.2f}x")
    if args.json:
        print(f"wrote {write_results_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
