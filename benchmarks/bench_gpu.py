"""Does the CUDA scan read at memory speed? A bf16 set shaped like a 1.3B-parameter GPT (parameters and gradients,
about 5 GB) timed side by side in one run against a read-only torch reduction over the same bytes (the ceiling),
torch._foreach_norm and a per-tensor isfinite().all() loop; prints a table, three ratio lines

    cuda/read_limit = 0.91          (scan bandwidth / read-only reduction bandwidth; target >= 0.85)
    cuda/isfinite_loop = 14.2x      (loop time / scan time; target >= 10x)
    cuda/foreach_norm = 1.6x        (_foreach_norm time / scan time; target > 1x)

and writes everything to --json. Results are validated (a planted NaN found exactly, records equal to the
reference backend's on a subset) before anything is timed. Run on the GPU machine through
benchmarks/gpu_check.sh; `--dry-run` checks argument parsing, the planned set and JSON writing without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import nanscan
from nanscan import _layout as L
from nanscan.inputs import prepare

TARGETS = {"cuda/read_limit": 0.85, "cuda/isfinite_loop": 10.0, "cuda/foreach_norm": 1.0}


def gpt_shapes(d_model: int = 2048, n_layer: int = 24, vocab: int = 50304, context: int = 2048,
               scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of a GPT-2-style model; the defaults give 1.3B parameters (GPT-3 XL). `scale` < 1 keeps
    the tensor count and shrinks every width, for quick runs."""
    d = max(8, int(round(d_model * math.sqrt(scale) / 8)) * 8)
    vocab = max(8, int(round(vocab * math.sqrt(scale) / 8)) * 8)
    context = max(8, int(round(context * math.sqrt(scale) / 8)) * 8)
    shapes = [("wte", (vocab, d)), ("wpe", (context, d))]
    for i in range(n_layer):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def build_set(shapes, device: torch.device, dtype: torch.dtype, seed: int):
    """Parameters and gradients as views of two flat buffers (like a DDP/FSDP bucket); returns the buffers and the
    named tensors in scan order."""
    numels = [math.prod(s) for _, s in shapes]
    total = sum(numels)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = torch.empty(total, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    grads = torch.empty(total, dtype=dtype, device=device).normal_(0.0, 1e-3, generator=gen)
    named: dict[str, torch.Tensor] = {}
    for kind, buf in (("param", params), ("grad", grads)):
        offset = 0
        for (name, shape), n in zip(shapes, numels):
            named[f"{kind}:{name}"] = buf[offset:offset + n].view(shape)
            offset += n
    return [params, grads], named


def time_gpu(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Milliseconds of GPU time per call, from CUDA events around each call (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_host(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Milliseconds of wall time per call on the host, waiting for the GPU after each timed call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return times


def validate(backend, named: dict[str, torch.Tensor], subset: list[str]) -> dict:
    """The scan must find one planted NaN exactly, report a clean set as clean, and match the reference backend
    slot for slot on `subset` (every slot but the float64 sum of squares, which may differ in its last bits)."""
    from nanscan._reference import ReferenceBackend

    inputs = [prepare(name, t) for name, t in named.items()]
    target_name = next(n for n in named if n.startswith("grad:") and "c_fc.weight" in n)
    target = named[target_name].view(-1)
    where = target.numel() // 3
    saved = target[where].clone()
    target[where] = float("nan")
    pending = backend.scan_async(inputs)
    records = pending.records()
    bad = [inputs[i].name for i in np.flatnonzero(records[:, L.REC_NAN:L.REC_NEGINF + 1].any(axis=1))]
    planted_ok = bad == [target_name] and int(records[[i.name for i in inputs].index(target_name), L.REC_NAN]) == 1
    planted_flag = float(pending.found_inf.item())
    target[where] = saved
    clean = backend.scan_async(inputs)
    clean_records = clean.records()
    clean_ok = not clean_records[:, L.REC_NAN:L.REC_NEGINF + 1].any() and float(clean.found_inf.item()) == 0.0
    numel_ok = all(int(clean_records[i, L.REC_ZERO]) + int(clean_records[i, L.REC_HIST:].sum()) == item.numel
                   for i, item in enumerate(inputs))
    sub = [inputs[[i.name for i in inputs].index(name)] for name in subset]
    want = ReferenceBackend().scan_records(sub)
    got = backend.scan_records(sub)
    int_slots = [k for k in range(L.RECORD_WIDTH) if k != L.REC_SUMSQ]
    reference_ok = bool((got[:, int_slots] == want[:, int_slots]).all())
    sumsq_rel = max((abs(float(g) - float(w)) / max(abs(float(w)), 1e-300)
                     for g, w in zip(got[:, L.REC_SUMSQ].view(np.float64), want[:, L.REC_SUMSQ].view(np.float64))),
                    default=0.0)
    result = {"planted_nan_found_exactly": planted_ok, "planted_found_inf": planted_flag,
              "clean_set_clean": clean_ok, "every_element_counted": numel_ok,
              "reference_subset": subset, "reference_equal": reference_ok, "sumsq_max_rel_diff": sumsq_rel}
    result["ok"] = (planted_ok and planted_flag == 1.0 and clean_ok and numel_ok and reference_ok
                    and sumsq_rel < 1e-9)
    return result


def summarize(times: list[float], nbytes: int) -> dict:
    median = statistics.median(times)
    return {"median_ms": median, "min_ms": min(times), "ms": times, "gb_per_s": nbytes / (median * 1e-3) / 1e9}


def write_json(path: Path, data: dict) -> None:
    """Written to a temporary file in the same directory, then renamed over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", suffix=".tmp",
                                     delete=False) as f:
        json.dump(data, f, indent=2, default=str)
        tmp = f.name
    os.replace(tmp, path)


def plan(args) -> dict:
    shapes = gpt_shapes(scale=args.scale)
    numel = sum(math.prod(s) for _, s in shapes)
    return {"model": "GPT, 24 layers, d_model 2048 (1.3B parameters)" if args.scale == 1.0
            else f"GPT, 24 layers, scaled by {args.scale}", "dtype": "bfloat16",
            "tensors": 2 * len(shapes), "parameters": numel, "bytes": 2 * numel * 2, "repeats": args.repeats}


def run(args) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    from nanscan._cuda_backend import CudaBackend

    backend = CudaBackend()
    shapes = gpt_shapes(scale=args.scale)
    buffers, named = build_set(shapes, device, torch.bfloat16, seed=0)
    tensors = list(named.values())
    inputs = [prepare(name, t) for name, t in named.items()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    subset = [n for n in named if n.startswith(("param:h.0.", "grad:h.0.", "param:ln_f"))]
    torch.cuda.synchronize()
    checks = validate(backend, named, subset)
    if not checks["ok"]:
        return {"validation": checks, "error": "validation failed; nothing was timed"}

    def read_limit():
        for buf in buffers:
            torch.sum(buf)

    def isfinite_loop():
        for t in tensors:
            if not bool(t.isfinite().all()):  # what a per-tensor check does: one host read per tensor
                raise AssertionError("non-finite value in the benchmark set")

    def isfinite_no_sync():
        flags = torch.stack([t.isfinite().all() for t in tensors])
        if not bool(flags.all()):
            raise AssertionError("non-finite value in the benchmark set")

    launches: list[float] = []

    def scan_async_launch():
        start = time.perf_counter()
        backend.scan_async(inputs)
        launches.append((time.perf_counter() - start) * 1e3)

    r = args.repeats
    results = {}
    # Interleaved rounds, so clock and thermal drift fall on every contender alike.
    rounds = {"read_limit": [], "scan_gpu": [], "scan_sync_wall": [], "foreach_norm": [], "isfinite_loop_wall": [],
              "isfinite_no_sync_wall": []}
    for _ in range(args.rounds):
        rounds["read_limit"] += time_gpu(read_limit, r)
        rounds["scan_gpu"] += time_gpu(scan_async_launch, r)
        rounds["scan_sync_wall"] += time_host(lambda: backend.scan_records(inputs), r)
        rounds["foreach_norm"] += time_gpu(lambda: torch._foreach_norm(tensors), r)
        rounds["isfinite_loop_wall"] += time_host(isfinite_loop, max(3, r // 4))
        rounds["isfinite_no_sync_wall"] += time_host(isfinite_no_sync, max(3, r // 4))
    for key, times in rounds.items():
        results[key] = summarize(times, nbytes)
    results["scan_async_launch_host"] = {"median_ms": statistics.median(launches), "max_ms": max(launches)}

    scan_ms = results["scan_gpu"]["median_ms"]
    ratios = {
        "cuda/read_limit": results["read_limit"]["median_ms"] / scan_ms,
        "cuda/isfinite_loop": results["isfinite_loop_wall"]["median_ms"] / scan_ms,
        "cuda/isfinite_no_sync": results["isfinite_no_sync_wall"]["median_ms"] / scan_ms,
        "cuda/foreach_norm": results["foreach_norm"]["median_ms"] / scan_ms,
        "cuda/sync_scan_read_limit": results["read_limit"]["median_ms"] / results["scan_sync_wall"]["median_ms"],
    }
    return {"validation": checks, "results": results, "ratios": ratios,
            "device": torch.cuda.get_device_name(device),
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (atomically)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per contender per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all contenders")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the model widths (1.0: 1.3B parameters)")
    parser.add_argument("--dry-run", action="store_true", help="plan and write JSON without touching a GPU")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or not 0 < args.scale <= 1.0:
        parser.error("--repeats and --rounds must be >= 1 and --scale in (0, 1]")

    out = {"benchmark": "bench_gpu", "plan": plan(args), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "python": platform.python_version(), "nanscan": nanscan.__version__, "targets": TARGETS,
           "dry_run": args.dry_run}
    try:
        out["build"] = dict(nanscan.backend_info().get("build", {}))
    except Exception as exc:  # noqa: BLE001 - the report says what is missing instead of failing
        out["build"] = {"error": f"{type(exc).__name__}: {exc}"}
    plan_line = (f"{out['plan']['model']}: {out['plan']['tensors']} bf16 tensors, "
                 f"{out['plan']['bytes'] / 1e9:.2f} GB")
    print(plan_line)
    status = 0
    if args.dry_run:
        print("dry run: nothing timed")
    elif not torch.cuda.is_available():
        out["error"] = "torch.cuda.is_available() is False: run this on a GPU machine (or pass --dry-run)"
        print(out["error"], file=sys.stderr)
        status = 2
    else:
        out.update(run(args))
        if "error" in out:
            print(f"error: {out['error']}: {json.dumps(out['validation'])}", file=sys.stderr)
            status = 1
        else:
            print(f"{'contender':<24}{'median ms':>12}{'GB/s':>10}")
            for key, value in out["results"].items():
                if "gb_per_s" in value:
                    print(f"{key:<24}{value['median_ms']:>12.3f}{value['gb_per_s']:>10.0f}")
            print(f"scan_async launch (host): {out['results']['scan_async_launch_host']['median_ms']:.3f} ms")
            ratios = out["ratios"]
            print(f"cuda/read_limit = {ratios['cuda/read_limit']:.2f}")
            print(f"cuda/isfinite_loop = {ratios['cuda/isfinite_loop']:.1f}x")
            print(f"cuda/isfinite_no_sync = {ratios['cuda/isfinite_no_sync']:.1f}x")
            print(f"cuda/foreach_norm = {ratios['cuda/foreach_norm']:.2f}x")
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
