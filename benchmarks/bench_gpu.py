"""Does the CUDA scan read at memory speed? A bf16 set shaped like a 1.3B-parameter GPT (parameters and gradients,
about 5 GB) timed side by side in one run against a read-only torch reduction over the same bytes (the ceiling),
torch._foreach_norm and a per-tensor isfinite().all() loop; prints a table, three ratio lines

    cuda/read_limit = 0.91          (scan bandwidth / read-only reduction bandwidth; target >= 0.85)
    cuda/isfinite_loop = 14.2x      (loop time / scan time; target >= 10x)
    cuda/foreach_norm = 1.6x        (_foreach_norm time / scan time; target > 1x)

and writes everything to --json. Results are validated (a planted NaN found exactly, records equal to the
reference backend's on a subset) before anything is timed.

A second part (run after the first by default; `--part scan` or `--part monitor` runs one) asks what
Monitor.check costs a real training step in mode="async": a GPT-2-medium-sized model (24 layers, d_model 1024,
355M parameters; bf16 autocast, fp32 weights, fused AdamW) trained on random tokens, 32K tokens per optimizer step
(two micro-batches of 16 x 1024; GPT-2's own steps are 0.5M tokens, so real runs pay a smaller share), steps with
the check (its found_inf passed to the optimizer) and without it timed in alternating blocks on the GPU's clock,
one ratio line:

    monitor_async_overhead = <x>% of step     ((checked - plain) / plain step time; target <= 1%)

Before timing, the check and the fused optimizer step taking its found_inf run under
torch.cuda.set_sync_debug_mode("error") for a few steps (no host sync may happen; syncs elsewhere in the step are
counted in the JSON), and the check must have scanned every parameter, gradient and optimizer state tensor and
found them finite.

Run on the GPU machine through benchmarks/gpu_check.sh; `--dry-run` checks argument parsing, the planned work and
JSON writing without a GPU.
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
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import nanscan
from nanscan.engine import _layout as L
from nanscan.engine.inputs import prepare

TARGETS = {"cuda/read_limit": 0.85, "cuda/isfinite_loop": 10.0, "cuda/foreach_norm": 1.0,
           "monitor_async_overhead_pct": 1.0}
PARTS = ("scan", "monitor")
# GPT-2 medium (vocabulary padded to a multiple of 64, as nanoGPT and llm.c do).
GPT2_MEDIUM = {"vocab": 50304, "context": 1024, "d_model": 1024, "n_layer": 24, "n_head": 16}


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


# GPU cycles of the busy-wait queued ahead of each timed call (~10 ms at H200 clocks): longer than any contender's
# host-side launch, so the GPU reaches the start event only once the whole call is already in its queue.
QUEUE_AHEAD_CYCLES = 20_000_000


def time_gpu(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Milliseconds of GPU time per call, from CUDA events around each call (after `warmup` untimed calls).

    Each call is queued behind a busy-wait kernel, as in a training step, where the GPU is still working through
    earlier kernels while the host launches the next ones. Without it the interval between the events also counts
    the GPU idling while the host prepares the launch (0.5 ms for the scan of 584 tensors, which builds its piece
    table first), and that is launch cost, reported on its own (scan_async_launch_host), not bandwidth.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
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
    from nanscan.engine.backends.reference import ReferenceBackend

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
    numel_ok = all(int(clean_records[i, L.REC_ZERO]) + int(clean_records[i, L.REC_HIST:L.REC_HIST_END].sum())
                   == item.numel
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
    from nanscan.engine.backends.cuda import CudaBackend

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


# -- Monitor.check in a training step -------------------------------------------------------------------------

class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 (pre-norm blocks, learned positions, output layer tied to the token embedding)."""

    def __init__(self, vocab: int, context: int, d_model: int, n_layer: int, n_head: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def monitor_plan(args) -> dict:
    with torch.device("meta"):
        model = GPT(**GPT2_MEDIUM)
    params = list(model.parameters())
    return {"model": "GPT-2 medium: 24 layers, d_model 1024, 16 heads, context 1024", "config": GPT2_MEDIUM,
            "parameters": sum(p.numel() for p in params), "parameter_tensors": len(params),
            "batch": args.gpt_batch, "seq": args.gpt_seq, "accumulate": args.gpt_accumulate,
            "tokens_per_step": args.gpt_batch * args.gpt_seq * args.gpt_accumulate,
            "precision": "bf16 autocast, fp32 weights, fused AdamW", "monitor": "mode='async', history=64",
            "blocks": args.gpt_blocks, "block_steps": args.gpt_block_steps}


class TrainingStep:
    """One GPT training step: forward, backward, AdamW; `checked` adds Monitor.check, whose found_inf the fused
    optimizer takes (a non-finite step's update would be skipped on the GPU)."""

    def __init__(self, args, device: torch.device, bundle_dir: Path):
        from nanscan.runtime.monitor import Monitor

        torch.manual_seed(0)
        self.model = GPT(**GPT2_MEDIUM).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        self.monitor = Monitor(self.model, self.optimizer, bundle_dir=bundle_dir, run_id="bench-gpu",
                               on_invalid="raise")
        gen = torch.Generator(device=device).manual_seed(1)
        self.batches = [torch.randint(0, GPT2_MEDIUM["vocab"], (args.gpt_batch, args.gpt_seq + 1), device=device,
                                      generator=gen) for _ in range(4)]
        self.count = 0
        self.accumulate = args.gpt_accumulate
        self.check_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.check_host_ms: list[float] = []

    def __call__(self, checked: bool, *, time_check: bool = False, strict_check: bool = False) -> None:
        """strict_check: the check and the optimizer step run under set_sync_debug_mode("error")."""
        micro_batches, loss = [], None
        for _ in range(self.accumulate):  # gradient accumulation: one optimizer step over several micro-batches
            tokens = self.batches[self.count % len(self.batches)]
            self.count += 1
            with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
                logits = self.model(tokens[:, :-1])
                micro = F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            (micro / self.accumulate).backward()
            micro = micro.detach() / self.accumulate
            loss = micro if loss is None else loss + micro
            micro_batches.append(tokens)
        if checked:
            if time_check:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
                start = time.perf_counter()
            if strict_check:
                torch.cuda.set_sync_debug_mode("error")
            try:
                report = self.monitor.check(batch={"tokens": micro_batches}, loss=loss)
                if time_check:
                    self.check_host_ms.append((time.perf_counter() - start) * 1e3)
                    after.record()
                    self.check_events.append((before, after))
                if report.ok:
                    self.optimizer.found_inf = report.found_inf
                    self.optimizer.step()
                    del self.optimizer.found_inf
            finally:
                if strict_check:
                    torch.cuda.set_sync_debug_mode("default")
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def validate_monitor(train: TrainingStep) -> dict:
    """The check must resolve to async mode, scan every parameter, gradient and optimizer state tensor, find them
    finite, and not synchronize the host with the GPU (nor may the fused optimizer taking its found_inf). Whether
    the rest of the step synchronizes is torch's business: it is counted, not required."""
    train(checked=False)  # creates the optimizer state
    train(checked=True)
    train(checked=True)  # reads the first check's verdict; warm pinned pools and work lists
    report = train.monitor.flush()
    names = report.names
    params = list(train.model.parameters())
    state = sum(1 for p in params for v in train.optimizer.state[p].values()
                if isinstance(v, torch.Tensor) and v.is_floating_point())
    counts = {prefix: sum(n.startswith(prefix) for n in names) for prefix in ("param:", "grad:", "optim:")}
    expected = {"param:": len(params), "grad:": len(params), "optim:": state}
    sync_error = None
    try:
        for _ in range(3):
            train(checked=True, strict_check=True)
    except RuntimeError as exc:
        sync_error = str(exc)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(checked=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    step_syncs = sorted({str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)})
    verdict = train.monitor.flush()
    scanned_bytes = int(sum(t.numel * torch.empty((), dtype=getattr(torch, t.dtype)).element_size()
                            for t in report.tensors))
    result = {"mode": train.monitor.mode, "scanned": counts, "expected": expected, "report_ok": report.ok,
              "found_inf": float(report.found_inf), "tensors_scanned": len(names), "bytes_scanned": scanned_bytes,
              "no_host_sync": sync_error is None, "sync_error": sync_error, "last_verdict_ok": verdict.ok,
              "whole_step_sync_warnings": step_syncs}
    result["ok"] = (result["mode"] == "async" and counts == expected and report.ok and result["found_inf"] == 0.0
                    and sync_error is None and verdict.ok and "loss" in names)
    return result


def run_monitor(args, device: torch.device | None = None) -> dict:
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-gpu-") as tmp:
        train = TrainingStep(args, device, Path(tmp))
        checks = validate_monitor(train)
        if not checks["ok"]:
            return {"validation": checks, "error": "monitor validation failed; nothing was timed"}
        for i in range(4):
            train(checked=bool(i % 2))
        torch.cuda.synchronize()
        # Blocks of steps timed on the GPU's clock, plain and checked alternating (drift falls on both alike). The
        # host runs ahead of the GPU inside a block, so a check that blocked the host would show as GPU idle time.
        per_step: dict[str, list[float]] = {"plain": [], "checked": []}
        pairs = []
        for block in range(args.gpt_blocks):
            order = ("plain", "checked") if block % 2 == 0 else ("checked", "plain")
            medians = {}
            for variant in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.gpt_block_steps):
                    train(checked=variant == "checked")
                end.record()
                end.synchronize()
                medians[variant] = start.elapsed_time(end) / args.gpt_block_steps
                per_step[variant].append(medians[variant])
            pairs.append(medians["checked"] / medians["plain"])
        for _ in range(args.gpt_block_steps):
            train(checked=True, time_check=True)
        torch.cuda.synchronize()
        check_gpu = [before.elapsed_time(after) for before, after in train.check_events]
        final = train.monitor.flush()
        train.monitor.close()
    plain, checked = statistics.median(per_step["plain"]), statistics.median(per_step["checked"])
    return {
        "validation": checks,
        "step_ms": {variant: {"median": statistics.median(v), "min": min(v), "blocks": v}
                    for variant, v in per_step.items()},
        "monitor_async_overhead_pct": 100.0 * (checked - plain) / plain,
        "paired_overhead_pct": 100.0 * (statistics.median(pairs) - 1.0),
        "check_gpu_ms": statistics.median(check_gpu),
        "check_gpu_pct_of_step": 100.0 * statistics.median(check_gpu) / plain,
        "check_host_ms": statistics.median(train.check_host_ms),
        "scan_gb_per_s": checks["bytes_scanned"] / (statistics.median(check_gpu) * 1e-3) / 1e9,
        "final_verdict_ok": final is not None and final.ok,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9,
    }


def print_monitor(result: dict) -> None:
    steps = result["step_ms"]
    print(f"{'training step':<24}{'median ms':>12}{'min ms':>10}")
    for variant in ("plain", "checked"):
        print(f"{variant:<24}{steps[variant]['median']:>12.2f}{steps[variant]['min']:>10.2f}")
    print(f"check on the GPU: {result['check_gpu_ms']:.3f} ms ({result['check_gpu_pct_of_step']:.2f}% of a plain "
          f"step, {result['scan_gb_per_s']:.0f} GB/s over {result['validation']['bytes_scanned'] / 1e9:.2f} GB); "
          f"on the host: {result['check_host_ms']:.2f} ms, overlapped with the GPU's work")
    print(f"adjacent blocks: median checked/plain = {result['paired_overhead_pct']:+.2f}%")
    print(f"monitor_async_overhead = {result['monitor_async_overhead_pct']:.2f}% of step")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (atomically)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per contender per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all contenders")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the model widths (1.0: 1.3B parameters)")
    parser.add_argument("--part", choices=("all", *PARTS), default="all",
                        help="scan: the kernel against torch; monitor: Monitor.check in a GPT-2-medium training step")
    parser.add_argument("--gpt-batch", type=int, default=16, help="sequences per training step (default 16)")
    parser.add_argument("--gpt-seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--gpt-accumulate", type=int, default=2,
                        help="micro-batches per optimizer step (default 2: 32K tokens per step)")
    parser.add_argument("--gpt-blocks", type=int, default=8, help="timed blocks, alternating plain/checked")
    parser.add_argument("--gpt-block-steps", type=int, default=5, help="training steps per timed block")
    parser.add_argument("--dry-run", action="store_true", help="plan and write JSON without touching a GPU")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or not 0 < args.scale <= 1.0:
        parser.error("--repeats and --rounds must be >= 1 and --scale in (0, 1]")
    if min(args.gpt_batch, args.gpt_accumulate, args.gpt_blocks, args.gpt_block_steps) < 1 \
            or not 1 <= args.gpt_seq <= 1024:
        parser.error("--gpt-batch, --gpt-accumulate, --gpt-blocks and --gpt-block-steps must be >= 1, --gpt-seq "
                     "in [1, 1024]")
    parts = PARTS if args.part == "all" else (args.part,)

    out = {"benchmark": "bench_gpu", "parts": list(parts), "plan": plan(args), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "python": platform.python_version(), "nanscan": nanscan.__version__,
           "targets": TARGETS, "dry_run": args.dry_run}
    if "monitor" in parts:
        out["monitor_plan"] = monitor_plan(args)
    try:
        out["build"] = dict(nanscan.backend_info().get("build", {}))
    except Exception as exc:  # noqa: BLE001 - the report says what is missing instead of failing
        out["build"] = {"error": f"{type(exc).__name__}: {exc}"}
    plan_line = (f"{out['plan']['model']}: {out['plan']['tensors']} bf16 tensors, "
                 f"{out['plan']['bytes'] / 1e9:.2f} GB")
    if "scan" in parts:
        print(plan_line)
    if "monitor" in parts:
        mp = out["monitor_plan"]
        print(f"{mp['model']}: {mp['parameters'] / 1e6:.0f}M parameters, {mp['tokens_per_step']} tokens per step, "
              f"{mp['precision']}")
    status = 0
    if args.dry_run:
        print("dry run: nothing timed")
    elif not torch.cuda.is_available():
        out["error"] = "torch.cuda.is_available() is False: run this on a GPU machine (or pass --dry-run)"
        print(out["error"], file=sys.stderr)
        status = 2
    else:
        if "scan" in parts:
            status = max(status, scan_part(out, args))
            if args.json and "monitor" in parts:  # kept if the monitor part runs out of time
                write_json(args.json, out)
        if "monitor" in parts:
            out["monitor"] = run_monitor(args)
            if "error" in out["monitor"]:
                print(f"error: {out['monitor']['error']}: {json.dumps(out['monitor']['validation'])}",
                      file=sys.stderr)
                status = 1
            else:
                print_monitor(out["monitor"])
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return status


def scan_part(out: dict, args) -> int:
    """The scan against torch's reductions: fills `out` and prints the table; 1 when validation failed."""
    out.update(run(args))
    if "error" in out:
        print(f"error: {out['error']}: {json.dumps(out['validation'])}", file=sys.stderr)
        return 1
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
