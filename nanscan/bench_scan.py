"""The scan benchmark's measurements: nanscan's CPU backends against the machine's read limit and the per-tensor torch
checks, on float32, bfloat16, float16 and then float8_e4m3fn and float8_e5m2 tensors shaped like GPT-2 small
(nanscan.cli.bench_options says what is measured, in the words of --help, and parses the arguments before this module
imports torch).

It prints a table per dtype and ratio lines, among them a read-limit line per dtype and backend (`cpu/read_limit =
0.78` for float32, `bfloat16 numba/read_limit = 0.31`, `cpu/isfinite_loop = 14.2x`) and the fallback beside the
kernel per dtype (`bfloat16 numba/cpu = 0.74x`, fallback_ratio), and with --json writes the same to a file.
`nanscan bench` and benchmarks/bench_scan.py run it; run it alone:
`flock /tmp/nanscan-bench.lock .venv/bin/python benchmarks/bench_scan.py --json benchmarks/results/bench_scan.json`
(`--scale 0.1` shrinks every tensor tenfold for a quick run). Before anything is timed, the backends' records are
checked against the reference scan on a slice of every tensor, and one scan's peak memory is measured: it must not
copy its inputs. Methods are timed in turn within each repetition, so drift in machine load falls on all of them
alike, and their order turns by one each repetition, so that no method always runs just after the same other one
(a read probe right after a slow torch loop has measured a fifth of the bandwidth); each reports its median. The
read probe, which takes a hundredth of a second, also runs just before every other method, so its median is of
many runs, taken where the scans are. The read limit is the faster of a torch.sum per tensor and nanscan's own
read probe (every byte read once, nothing else).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine import backends
from nanscan._atomic import write_results_json
from nanscan.engine.backends.reference import scan_one
from nanscan.cli.bench_options import parse_args
from nanscan.engine.inputs import prepare_all
from nanscan.scan import scan

# GPT-2 small (124M parameters): vocabulary, context, width, depth.
VOCAB, CONTEXT, WIDTH, LAYERS = 50257, 1024, 768, 12
# Elements of each tensor checked against the reference before timing.
VALIDATION_SLICE = 1 << 16
# A scan may use this much memory beyond its result (partial records, one per thread and tensor, and each chunk's sum
# of squares), as a fraction of its inputs, plus a fixed allowance: the resident-set peak moves in pages and
# allocator arenas, which on a tiny run (the test's 2 MiB of inputs) outweigh 2% of the inputs although nothing grows
# with them.
MAX_EXTRA_MEMORY_FRACTION = 0.02
EXTRA_MEMORY_SLACK_BYTES = 4 << 20


def cpu_model() -> dict:
    """The CPU the numbers were taken on: /proc/cpuinfo's model name, family and model (a virtual machine may name
    only "AMD EPYC": family 25 model 17 is Zen 4, family 26 Zen 5), where Linux gives them; the results of one
    kernel differ by several tenths of the read limit between CPU kinds, so a result names its kind."""
    wanted = {"model name": "model_name", "cpu family": "family", "model": "model"}
    found: dict = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in wanted and wanted[key] not in found:
                    found[wanted[key]] = value.strip()
                if not line.strip() and found:
                    break  # the first processor's block
    except OSError:
        pass
    return found or {"model_name": platform.processor() or platform.machine()}


def gpt2_small_shapes(scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of GPT-2 small; `scale` shrinks each tensor's first dimension (at least 1)."""
    shapes = [("wte.weight", (VOCAB, WIDTH)), ("wpe.weight", (CONTEXT, WIDTH))]
    for i in range(LAYERS):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (WIDTH,)), (p + "ln_1.bias", (WIDTH,)),
            (p + "attn.c_attn.weight", (WIDTH, 3 * WIDTH)), (p + "attn.c_attn.bias", (3 * WIDTH,)),
            (p + "attn.c_proj.weight", (WIDTH, WIDTH)), (p + "attn.c_proj.bias", (WIDTH,)),
            (p + "ln_2.weight", (WIDTH,)), (p + "ln_2.bias", (WIDTH,)),
            (p + "mlp.c_fc.weight", (WIDTH, 4 * WIDTH)), (p + "mlp.c_fc.bias", (4 * WIDTH,)),
            (p + "mlp.c_proj.weight", (4 * WIDTH, WIDTH)), (p + "mlp.c_proj.bias", (WIDTH,)),
        ]
    shapes += [("ln_f.weight", (WIDTH,)), ("ln_f.bias", (WIDTH,))]
    return [(name, (max(1, math.ceil(shape[0] * scale)),) + shape[1:]) for name, shape in shapes]


def make_tensors(scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameters as GPT-2 initialises them and gradients of a plausible mid-training step, all float32.

    The values shape the scan's work, so they are realistic: weights N(0, 0.02) (output projections scaled down
    with depth), LayerNorm weights 1 and biases 0; gradients Gaussian with per-tensor scales spread over 1e-5..1e-2,
    and the token embedding's gradient zero in the rows of tokens absent from the batch (most of them).
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in gpt2_small_shapes(scale):
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            param = torch.ones(shape)
        elif name.endswith(".bias"):
            param = torch.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith("c_proj.weight") else 0.02
            param = torch.randn(shape, generator=gen) * std
        grad_scale = 10.0 ** (-5 + 3 * float(torch.rand((), generator=gen)))
        grad = torch.randn(shape, generator=gen) * grad_scale
        if name == "wte.weight":
            grad[torch.rand(shape[0], generator=gen) < 0.85] = 0.0
        out[f"param:{name}"] = param
        out[f"grad:{name}"] = grad
    return out


@dataclass
class Method:
    name: str
    kind: str  # "read_limit", "nanscan" or "torch"
    run: Callable[[], object]
    detail: str


FLOAT8_DTYPE = torch.float8_e4m3fn
FLOAT8_MAX = 448.0  # torch.finfo(FLOAT8_DTYPE).max: float8 recipes scale each tensor's amax to it
# Both float8 formats are measured: e5m2's 32 exponent fields make its scan the costlier one (NOTE: [byte vectors]
# in csrc/cpu/scan_cpu.cpp). Each set has twice GPT-2 small's elements (~0.5 GB, far beyond the caches), so the two
# take the time one set of four times the elements took.
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT8_ELEMENTS_PER_PARAMETER = 2


def make_float8_tensors(scale: float = 1.0, seed: int = 0,
                        dtype: torch.dtype = FLOAT8_DTYPE) -> dict[str, torch.Tensor]:
    """GPT-2-small-shaped parameters and gradients with FLOAT8_ELEMENTS_PER_PARAMETER times the elements, each
    scaled as float8 recipes scale a tensor (its amax to the format's largest value, 448 for float8_e4m3fn) and cast
    to `dtype`; the token embedding's gradient is zero in most rows, as in make_tensors. Made one tensor at a time:
    the whole set in float32 first would need four times the memory."""
    largest = float(torch.finfo(dtype).max)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in gpt2_small_shapes(FLOAT8_ELEMENTS_PER_PARAMETER * scale):
        for kind in ("param", "grad"):
            x = torch.randn(shape, generator=gen)
            if kind == "grad" and name == "wte.weight":
                x[torch.rand(shape[0], generator=gen) < 0.85] = 0.0
            out[f"{kind}:{name}"] = (x * (largest / x.abs().max())).to(dtype)
    return out


# float16 gradients are held loss-scaled in mixed-precision training (GradScaler starts at 2**16): unscaled, most of
# these gradients would be float16 subnormals, which no run keeps.
FLOAT16_LOSS_SCALE = 2.0 ** 16
HALF_DTYPES = (torch.bfloat16, torch.float16)


def make_half_tensors(float32: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The float32 set as a 16-bit training run holds it: cast to bfloat16, or to float16 with the gradients
    loss-scaled (FLOAT16_LOSS_SCALE)."""
    scale = FLOAT16_LOSS_SCALE if dtype == torch.float16 else 1.0
    return {name: (t * scale if name.startswith("grad:") and scale != 1.0 else t).to(dtype)
            for name, t in float32.items()}


def _read_probe(tensors: list[torch.Tensor], code: int = L.FLOAT32) -> Callable[[], object] | None:
    """nanscan._C.read_bandwidth_probe over the tensors (every byte read once, nothing else), if built."""
    try:
        from nanscan import _C  # noqa: PLC0415 - optional extension
    except ImportError:
        return None
    ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    numels = np.array([t.numel() for t in tensors], dtype=np.int64)
    codes = np.full(len(tensors), code, dtype=np.int32)
    return lambda: _C.read_bandwidth_probe(ptrs, numels, codes, L.DEFAULT_CHUNK_ELEMS)


def _isfinite_loop(tensors: list[torch.Tensor]) -> bool:
    ok = True
    for t in tensors:
        ok &= bool(torch.isfinite(t).all())
    return ok


def _float_isfinite_loop(tensors: list[torch.Tensor]) -> bool:
    # torch has no isfinite for float8 on every path: the usual check casts each tensor up first.
    ok = True
    for t in tensors:
        ok &= bool(t.float().isfinite().all())
    return ok


def _log2_histc_loop(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # What wandb.watch-style histograms compute; the clamp keeps log2(0) = -inf inside histc's fixed range,
    # which also spares histc a pass to find the range.
    return [t.abs().log2().clamp(-128, 127).histc(bins=256, min=-128, max=128) for t in tensors]


def available_backends() -> tuple[list[str], dict[str, str]]:
    """Names of the nanscan CPU backends that load here, and why the others do not."""
    names, missing = [], {}
    for name in ("cpu", "numba"):
        try:
            backends.load(name)
            names.append(name)
        except backends.BackendUnavailable as exc:
            missing[name] = str(exc)
    return names, missing


def _read_limit_and_nanscan(named: dict[str, torch.Tensor], backend_names: list[str], code: int) -> list[Method]:
    """The read-limit methods (a torch sum per tensor, the read probe) and each nanscan backend, for one dtype."""
    tensors = list(named.values())
    # torch sums no float8 tensor: the same bytes as uint8 are read instead.
    as_summable = (lambda t: t.view(torch.uint8)) if code in L.FLOAT8_CODES else (lambda t: t)
    methods = [Method("torch.sum loop", "read_limit", lambda: [as_summable(t).sum() for t in tensors],
                      f"t.sum() per tensor, {torch.get_num_threads()} torch threads")]
    probe = _read_probe(tensors, code)
    if probe is not None:
        methods.append(Method("read probe", "read_limit", probe, "nanscan._C.read_bandwidth_probe, OpenMP"))
    for name in backend_names:
        methods.append(Method(f"nanscan {name}", "nanscan", lambda b=name: scan(named, backend=b),
                              f"nanscan.scan(tensors, backend={name!r}), end to end"))
    return methods


def make_float8_methods(named: dict[str, torch.Tensor], backend_names: list[str],
                        dtype: torch.dtype = FLOAT8_DTYPE) -> list[Method]:
    tensors = list(named.values())
    return _read_limit_and_nanscan(named, backend_names, L.DTYPE_CODES[str(dtype).removeprefix("torch.")]) + [
        Method("float isfinite loop", "torch", lambda: _float_isfinite_loop(tensors),
               "t.float().isfinite().all() per tensor")]


def make_half_methods(named: dict[str, torch.Tensor], backend_names: list[str], code: int) -> list[Method]:
    tensors = list(named.values())
    return _read_limit_and_nanscan(named, backend_names, code) + [
        Method("isfinite loop", "torch", lambda: _isfinite_loop(tensors), "torch.isfinite(t).all() per tensor")]


def make_methods(named: dict[str, torch.Tensor], backend_names: list[str]) -> list[Method]:
    tensors = list(named.values())
    methods = _read_limit_and_nanscan(named, backend_names, L.FLOAT32)
    methods += [
        Method("_foreach_norm", "torch", lambda: torch._foreach_norm(tensors), "torch._foreach_norm(tensors)"),
        Method("isfinite loop", "torch", lambda: _isfinite_loop(tensors), "torch.isfinite(t).all() per tensor"),
        Method("log2 histc loop", "torch", lambda: _log2_histc_loop(tensors),
               "t.abs().log2().clamp(-128, 127).histc(256) per tensor"),
    ]
    return methods


def validate(named: dict[str, torch.Tensor], backend_names: list[str]) -> list[str]:
    """Problems found comparing each backend with the reference on the first VALIDATION_SLICE elements of every
    tensor: every count, extreme and histogram bin must be equal, the sum of squares equal to 1e-12."""
    sliced = {name: t.reshape(-1)[:VALIDATION_SLICE] for name, t in named.items()}
    inputs, _ = prepare_all(sliced)
    expected = np.stack([scan_one(item.flat, item.scanned_code) for item in inputs])
    problems = []
    exact = [k for k in range(L.RECORD_WIDTH) if k != L.REC_SUMSQ]
    for name in backend_names:
        got = backends.load(name).scan_records(inputs)
        for i, item in enumerate(inputs):
            if not np.array_equal(got[i, exact], expected[i, exact]):
                slots = [int(k) for k in np.flatnonzero(got[i] != expected[i]) if k != L.REC_SUMSQ]
                problems.append(f"{name}: {item.name}: record slots {slots[:8]} differ from the reference")
            s_got = got[i, L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0]
            s_ref = expected[i, L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0]
            if not math.isclose(s_got, s_ref, rel_tol=1e-12, abs_tol=0.0):
                problems.append(f"{name}: {item.name}: sum of squares {s_got!r} != reference {s_ref!r}")
    return problems


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Peak resident memory `fn` adds to the process, or None where Linux's peak-reset is unavailable."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field)

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set, to the current one
        before = status("VmRSS")
    except (OSError, KeyError):
        return None
    fn()
    return max(0, status("VmHWM") - before)


def time_methods(methods: list[Method], reps: int) -> dict[str, list[float]]:
    """Seconds per run of each method; every method runs once untimed first (JIT, caches, thread pools).

    The order turns by one each repetition, and the read probe (if there is one) also runs just before each other
    method. On the shared 2-core machine, whatever ran right after a slow torch loop has taken up to five times its
    time (the read probe 0.058 s instead of 0.012 in 5 of 7 repetitions, so its median set a read limit of a fifth
    of what the scan read); in a fixed order that falls on one method every time. Timed before every method, the
    probe's many runs are taken in the conditions each method meets, and a few slow ones move its median little."""
    for m in methods:
        m.run()
    probe = next((m for m in methods if m.name == "read probe"), None)
    times: dict[str, list[float]] = {m.name: [] for m in methods}

    def timed(m: Method) -> None:
        start = time.perf_counter()
        m.run()
        times[m.name].append(time.perf_counter() - start)

    for rep in range(reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            if probe is not None and m is not probe:
                timed(probe)
            timed(m)
    return times


def summarise(methods: list[Method], times: dict[str, list[float]], total_bytes: int,
              baseline: str) -> tuple[str, list[dict]]:
    """(the fastest read-limit method, one result per method): medians, GB/s, fractions of the read limit and
    speedups over the `baseline` method."""
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    read_limit_name = min((m.name for m in methods if m.kind == "read_limit"), key=medians.__getitem__)
    read_limit = medians[read_limit_name]
    key = "speedup_vs_" + baseline.replace(" ", "_")
    return read_limit_name, [{
        "name": m.name, "kind": m.kind, "detail": m.detail, "seconds": medians[m.name],
        "seconds_all": times[m.name], "gb_per_s": total_bytes / medians[m.name] / 1e9,
        "fraction_of_read_limit": read_limit / medians[m.name], key: medians[baseline] / medians[m.name],
    } for m in methods]


def dtype_ratio_lines(results: list[dict], backend_names: list[str], dtype: torch.dtype,
                      baseline: str) -> dict[str, float]:
    """`<dtype> <backend>/read_limit` and `<dtype> <backend>/<baseline>` for a set other than the float32 one."""
    by_name = {r["name"]: r for r in results}
    prefix = str(dtype).removeprefix("torch.")
    ratios: dict[str, float] = {}
    for b in backend_names:
        r = by_name[f"nanscan {b}"]
        ratios[f"{prefix} {b}/read_limit"] = r["fraction_of_read_limit"]
        ratios[f"{prefix} {b}/{baseline.replace(' ', '_')}"] = by_name[baseline]["seconds"] / r["seconds"]
    ratios.update(fallback_ratio(by_name, backend_names, f"{prefix} "))
    return ratios


def fallback_ratio(by_name: dict[str, dict], backend_names: list[str], prefix: str = "") -> dict[str, float]:
    """`numba/cpu`: how fast the fallback is beside the C++ kernel, both timed in the same rounds. Unlike the
    read-limit lines it does not move with the read probe, whose median on one set has swung by half between runs
    of the same hour on a shared 2-core machine (10.3 and 15.9 ms for the same 0.5 GB)."""
    if not {"cpu", "numba"} <= set(backend_names):
        return {}
    return {f"{prefix}numba/cpu": by_name["nanscan cpu"]["seconds"] / by_name["nanscan numba"]["seconds"]}


def ratio_lines(results: list[dict], backend_names: list[str]) -> dict[str, float]:
    by_name = {r["name"]: r for r in results}
    ratios: dict[str, float] = {}
    for b in backend_names:
        r = by_name[f"nanscan {b}"]
        ratios[f"{b}/read_limit"] = r["fraction_of_read_limit"]
        for other, key in (("isfinite loop", "isfinite_loop"), ("_foreach_norm", "foreach_norm"),
                           ("log2 histc loop", "log2_histc_loop")):
            ratios[f"{b}/{key}"] = by_name[other]["seconds"] / r["seconds"]
    ratios.update(fallback_ratio(by_name, backend_names))
    return ratios


def results_table(results: list[dict], title: str, baseline: str):
    from rich.table import Table  # noqa: PLC0415 - only the command needs it

    table = Table(title=title)
    for col in ("method", "seconds", "GB/s", "x read limit", f"vs {baseline}"):
        table.add_column(col, justify="left" if col == "method" else "right")
    key = "speedup_vs_" + baseline.replace(" ", "_")
    for r in results:
        table.add_row(r["name"], f"{r['seconds']:.4f}", f"{r['gb_per_s']:.2f}", f"{r['fraction_of_read_limit']:.2f}",
                      f"{r[key]:.1f}x")
    return table


def format_ratio(key: str, value: float) -> str:
    return f"{key} = {value:.2f}" if key.endswith("/read_limit") else f"{key} = {value:.2f}x"


def _measure_set(console, named: dict[str, torch.Tensor], nbytes: int, dtype: torch.dtype, backend_names: list[str],
                 reps: int, baseline: str, methods: Callable[[], list[Method]],
                 ratios: dict[str, float]) -> tuple[str, list[dict]] | None:
    """Validate, time and print one extra dtype's set, adding its ratio lines to `ratios`: (read limit method,
    results), or None when validation failed (printed)."""
    problems = validate(named, backend_names)
    if problems:
        for p in problems[:20]:
            console.print(f"[red]validation failed ({dtype}):[/red] {p}")
        return None
    made = methods()
    read_limit, results = summarise(made, time_methods(made, reps), nbytes, baseline)
    console.print(results_table(results, f"scan of {nbytes / 1e9:.2f} GB of {dtype} (validated against the "
                                         f"reference), median of {reps} (read limit: {read_limit})", baseline))
    ratios.update(dtype_ratio_lines(results, backend_names, dtype, baseline))
    return read_limit, results


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The whole benchmark, for parsed arguments (nanscan.cli.bench_options.parse_args); 0 when every check passed."""
    from rich.console import Console  # noqa: PLC0415 - only the command needs it

    console = Console(soft_wrap=True)
    backend_names, missing = available_backends()
    if not backend_names:
        console.print(f"[red]no nanscan CPU backend can run here:[/red] {missing}")
        return 1
    named = make_tensors(args.scale, args.seed)
    total_bytes = sum(t.numel() * t.element_size() for t in named.values())
    total_elems = sum(t.numel() for t in named.values())
    build = backends.backend_info().get("build", {})
    cpu = cpu_model()
    console.print(f"CPU {cpu.get('model_name', '?')} (family {cpu.get('family', '?')}, model {cpu.get('model', '?')})")
    console.print(f"{len(named)} float32 tensors, {total_elems / 1e6:.1f}M elements, {total_bytes / 1e9:.3f} GB; "
                  f"torch threads {torch.get_num_threads()}, OpenMP threads {build.get('max_threads', '?')}, "
                  f"CPU kernel SIMD {build.get('cpu_simd', '?')} (float8: {build.get('cpu_float8', '?')}), "
                  f"{os.cpu_count()} CPUs")
    for name, why in missing.items():
        console.print(f"[yellow]nanscan {name} not measured:[/yellow] {why}")

    problems = validate(named, backend_names)
    if problems:
        for p in problems[:20]:
            console.print(f"[red]validation failed:[/red] {p}")
        return 1
    console.print(f"validated {', '.join(backend_names)} against the reference on {len(named)} slices of "
                  f"{VALIDATION_SLICE} elements: equal")

    memory: dict[str, float | None] = {}
    for b in backend_names:
        scan(named, backend=b)  # compile and warm first: the measured call is a steady-state one
        extra = peak_extra_bytes(lambda b=b: scan(named, backend=b))
        memory[b] = extra
        if extra is None:
            console.print("peak memory of a scan: not measurable here (needs Linux /proc/self/clear_refs)")
            continue
        result_bytes = len(named) * L.RECORD_WIDTH * 8
        console.print(f"peak extra memory of one {b} scan: {extra / 2**20:.1f} MiB for {total_bytes / 2**20:.0f} "
                      f"MiB of inputs (result {result_bytes / 2**10:.0f} KiB)")
        if extra > result_bytes + MAX_EXTRA_MEMORY_FRACTION * total_bytes + EXTRA_MEMORY_SLACK_BYTES:
            console.print(f"[red]the {b} scan used more memory than its result and workspace should[/red]")
            return 1

    methods = make_methods(named, backend_names)
    times = time_methods(methods, args.reps)
    read_limit_name, results = summarise(methods, times, total_bytes, "isfinite loop")
    console.print(results_table(results, f"scan of {total_bytes / 1e9:.2f} GB, median of {args.reps} (read limit: "
                                         f"{read_limit_name})", "isfinite loop"))
    ratios = ratio_lines(results, backend_names)
    num_tensors = len(named)
    halves: dict[str, dict] = {}
    for dtype in HALF_DTYPES:
        half = make_half_tensors(named, dtype)
        half_bytes = sum(t.numel() * t.element_size() for t in half.values())
        measured = _measure_set(console, half, half_bytes, dtype, backend_names, args.reps, "isfinite loop",
                                lambda: make_half_methods(half, backend_names,
                                                          L.DTYPE_CODES[str(dtype).removeprefix("torch.")]), ratios)
        if measured is None:
            return 1
        halves[str(dtype).removeprefix("torch.")] = {"tensors": len(half), "bytes": half_bytes,
                                                     "read_limit": measured[0], "results": measured[1]}
        del half
    del named, methods  # the float8 set takes their place

    float8_sets: dict[str, dict] = {}
    for dtype8 in FLOAT8_DTYPES:
        float8 = make_float8_tensors(args.scale, args.seed, dtype8)
        float8_bytes = sum(t.numel() for t in float8.values())
        measured = _measure_set(console, float8, float8_bytes, dtype8, backend_names, args.reps,
                                "float isfinite loop", lambda: make_float8_methods(float8, backend_names, dtype8),
                                ratios)
        if measured is None:
            return 1
        float8_sets[str(dtype8).removeprefix("torch.")] = {
            "dtype": str(dtype8).removeprefix("torch."), "tensors": len(float8), "bytes": float8_bytes,
            "read_limit": measured[0], "results": measured[1]}
        del float8
    for key, value in ratios.items():
        print(format_ratio(key, value))

    if args.json:
        write_results_json(args.json, {
            "benchmark": "bench_scan",
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu": cpu,
                        "cpu_count": os.cpu_count(), "torch": torch.__version__,
                        "torch_threads": torch.get_num_threads(), "build": build},
            "config": {"scale": args.scale, "reps": args.reps, "seed": args.seed, "tensors": num_tensors,
                       "elements": total_elems, "bytes": total_bytes},
            "validation": {"backends": backend_names, "slice": VALIDATION_SLICE, "problems": problems},
            "unavailable": missing,
            "peak_extra_memory_bytes": memory,
            "read_limit": read_limit_name,
            "results": results,
            **halves,
            "float8": float8_sets["float8_e4m3fn"],  # the key the results had before e5m2 was measured too
            "float8_e5m2": float8_sets["float8_e5m2"],
            "ratios": ratios,
        })
        console.print(f"wrote {args.json}")
    return 0
