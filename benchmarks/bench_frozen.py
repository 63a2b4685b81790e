"""What do frozen weights cost a check and a bundle? A small GPT-2 (transformers.GPT2Config, nothing downloaded) with
PEFT LoRA adapters (the base frozen, the adapters trained by AdamW) checked by a Monitor that reads its frozen
weights only when they change (the default, nanscan.engine.plans NOTE: [frozen records]) and by one that reads them at
every check (`source=ModelScanPlan(frozen_period=0)`, the behaviour before), side by side in one run:

    check_time(frozen carried / read every check) = <r>x      (median check() time, adjacent blocks)
    step_time(frozen carried / read every check) = <r>x       (forward + backward + check + update)
    bundle_bytes(frozen by digest / copied) = <r>x            (the whole bundle directory)
    state_bytes(frozen by digest / copied) = <r>x             (state.safetensors)

Run it alone: `flock /tmp/nanscan-bench.lock .venv/bin/python benchmarks/bench_frozen.py --json
benchmarks/results/bench_frozen.json` (`--quick`: a smoke run of a few seconds). Blocks of steps alternate between
the two Monitors (carried, read, read, carried, ...) on the same model, so drift in machine load falls on both
alike; the headline is the median over block pairs of the ratio of their median check times. Validated before
anything is timed: at the same step both Monitors' records are equal (`==`), the carrying one read the frozen
weights once and carried them since, and the frozen weights are most of what a check reads. The bundle sizes come
from a NaN planted in one adapter gradient, caught by a Monitor with frozen_weights="digest" (the default) and one
with "copy"; the digest bundle's references are checked against the model's weights.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nanscan import backend_info
from nanscan._atomic import write_results_json
from nanscan.bundle import load_bundle
from nanscan.bundle.format import STATE
from nanscan.bundle.frozen import tensor_sha256
from nanscan.runtime.monitor import Monitor, NonFiniteError
from nanscan.engine.plans import ModelScanPlan

GPT2 = {"vocab_size": 2000, "n_positions": 64, "n_embd": 256, "n_layer": 4, "n_head": 4}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True}
VARIANTS = ("carried", "read")


def lora_gpt2(seed: int = 0):
    """A GPT-2 built from its config, with LoRA adapters: (model, whether peft made them)."""
    import transformers  # noqa: PLC0415 - the benchmark's own dependency, not nanscan's

    torch.manual_seed(seed)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0))
    import peft  # noqa: PLC0415

    return peft.get_peft_model(base, peft.LoraConfig(**LORA, task_type="CAUSAL_LM"))


def batches(count: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, GPT2["vocab_size"], (batch_size, seq_len), generator=g) for _ in range(count)]


class Trainer:
    """One model and optimizer, checked by the two Monitors in turn (each counting its own steps)."""

    def __init__(self, bundle_dir: Path):
        self.model = lora_gpt2()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        self.monitors = {
            "carried": Monitor(self.model, self.optimizer, bundle_dir=bundle_dir, run_id="carried", mode="sync"),
            "read": Monitor(self.model, self.optimizer, bundle_dir=bundle_dir, run_id="read", mode="sync",
                            source=ModelScanPlan(frozen_period=0)),
        }
        self.steps = dict.fromkeys(VARIANTS, 0)
        self.check_seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def step(self, tokens: torch.Tensor, variant: str, *, update: bool = True):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        start = time.perf_counter()
        report = self.monitors[variant].check(batch={"input_ids": tokens}, loss=loss, step=self.steps[variant])
        self.check_seconds[variant].append(time.perf_counter() - start)
        self.steps[variant] += 1
        if update:
            self.optimizer.step()
        return report


def validate(trainer: Trainer, data: list[torch.Tensor]) -> dict:
    """Both Monitors give equal records at the same step, the carrying one carried, and what is frozen."""
    for i in range(4):  # the rebuild, Adam's state (a rebuild), then checks that read and then carry
        for variant in VARIANTS:
            trainer.step(data[i], variant, update=False)
        trainer.optimizer.step()
    carried = trainer.step(data[4], "carried", update=False)
    read = trainer.step(data[4], "read")
    if carried.names != read.names or not np.array_equal(np.array(carried.records), np.array(read.records)):
        raise SystemExit("validation failed: the carrying Monitor's records differ from the one that reads all")
    plan = trainer.monitors["carried"]._plan
    if plan.frozen_rescans != 1 or plan._frozen_checks < 1 or trainer.monitors["read"]._plan._frozen_part:
        raise SystemExit("validation failed: the default Monitor did not carry its frozen weights (or the other did)")
    frozen = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
    scanned = sum(s.numel for s in read.stats)
    return {"frozen_elements": frozen, "elements_per_check": scanned, "frozen_share": frozen / scanned,
            "frozen_tensors": len(plan._frozen), "tensors_per_check": len(read.names)}


def timed(trainer: Trainer, data: list[torch.Tensor], reps: int, block: int, warmup: int) -> dict:
    for i in range(warmup):
        trainer.step(data[i % len(data)], VARIANTS[i % 2])
    for seconds in trainer.check_seconds.values():
        seconds.clear()
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    check_ratios, step_ratios, n = [], [], 0
    for rep in range(reps):
        medians = {}
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            before = len(trainer.check_seconds[variant])
            block_steps = []
            for _ in range(block):
                start = time.perf_counter()
                trainer.step(data[n % len(data)], variant)
                block_steps.append(time.perf_counter() - start)
                n += 1
            steps[variant] += block_steps
            medians[variant] = (statistics.median(trainer.check_seconds[variant][before:]),
                                statistics.median(block_steps))
        check_ratios.append(medians["carried"][0] / medians["read"][0])
        step_ratios.append(medians["carried"][1] / medians["read"][1])
    for variant, monitor in trainer.monitors.items():
        if monitor.first_invalid_step is not None or monitor.spikes:
            raise SystemExit(f"validation failed: the healthy run of {variant} reported an incident or a spike")
    return {
        "check_ratio": statistics.median(check_ratios), "step_ratio": statistics.median(step_ratios),
        "check_ms": {v: 1e3 * statistics.median(trainer.check_seconds[v]) for v in VARIANTS},
        "step_ms": {v: 1e3 * statistics.median(steps[v]) for v in VARIANTS},
        "frozen_rescans": trainer.monitors["carried"]._plan.frozen_rescans,
    }


def bundle_sizes(tmp: Path, data: list[torch.Tensor]) -> dict:
    """A NaN in one adapter's gradient, caught with frozen weights by digest and copied: the bundles' sizes."""
    out = {}
    for how in ("digest", "copy"):
        model = lora_gpt2()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        mon = Monitor(model, optimizer, bundle_dir=tmp / how, run_id=how, mode="sync", frozen_weights=how)
        adapter = next(p for n, p in model.named_parameters() if "lora_B" in n)
        for i, tokens in enumerate(data[:3]):
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if i == 2:
                adapter.grad[0, 0] = float("nan")
            start = time.perf_counter()
            try:
                mon.check(batch={"input_ids": tokens}, loss=loss)
            except NonFiniteError as exc:
                path = Path(exc.bundle_path)
                break
            optimizer.step()
        else:
            raise SystemExit("validation failed: the planted NaN was not caught")
        seconds = time.perf_counter() - start
        bundle = load_bundle(path)
        references = bundle.frozen_references()
        frozen = {k: v for k, v in model.state_dict(keep_vars=True).items()
                  if isinstance(v, torch.nn.Parameter) and not v.requires_grad}
        if how == "digest" and (set(references) != set(frozen) or any(
                tensor_sha256(frozen[k]) != ref["sha256"] for k, ref in references.items())):
            raise SystemExit("validation failed: the digest bundle does not reference every frozen weight by its sha256")
        out[how] = {"bundle_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                    "state_bytes": (path / STATE).stat().st_size, "frozen_references": len(references),
                    "check_and_write_seconds": seconds}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="block pairs")
    parser.add_argument("--block", type=int, default=6, help="steps per block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 block pairs of 2 steps")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.block, args.warmup = 2, 2, 2
    load_before = os.getloadavg()[0]
    data = batches(16, args.batch_size, args.seq_len)
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-frozen-") as tmp:
        trainer = Trainer(Path(tmp) / "timed")
        shape = validate(trainer, data)
        timing = timed(trainer, data, args.reps, args.block, args.warmup)
        sizes = bundle_sizes(Path(tmp), data)
    import peft  # noqa: PLC0415

    results = {
        "question": "check time and bundle size of a PEFT LoRA GPT-2 with its frozen base carried / by digest",
        "gpt2": GPT2, "lora": LORA, "adapters": f"peft {peft.__version__}",
        "parameters": sum(p.numel() for p in trainer.model.parameters()), **shape,
        "batch": [args.batch_size, args.seq_len], "reps": args.reps, "block": args.block, "warmup": args.warmup,
        **timing, "bundles": sizes,
        "bundle_ratio": sizes["digest"]["bundle_bytes"] / sizes["copy"]["bundle_bytes"],
        "state_ratio": sizes["digest"]["state_bytes"] / sizes["copy"]["state_bytes"],
        "backend": backend_info(), "torch": torch.__version__, "python": sys.version.split()[0],
        "machine": platform.machine(), "threads": torch.get_num_threads(),
        "load_average": [load_before, os.getloadavg()[0]],
    }
    print(f"frozen share of a check = {shape['frozen_share']:.1%} of the elements "
          f"({shape['frozen_tensors']} of {shape['tensors_per_check']} tensors)")
    print(f"check_time(frozen carried / read every check) = {results['check_ratio']:.3f}x "
          f"({timing['check_ms']['carried']:.3f} ms / {timing['check_ms']['read']:.3f} ms, medians)")
    print(f"step_time(frozen carried / read every check) = {results['step_ratio']:.3f}x "
          f"({timing['step_ms']['carried']:.2f} ms / {timing['step_ms']['read']:.2f} ms, medians)")
    print(f"bundle_bytes(frozen by digest / copied) = {results['bundle_ratio']:.3f}x "
          f"({sizes['digest']['bundle_bytes'] / 1e6:.2f} MB / {sizes['copy']['bundle_bytes'] / 1e6:.2f} MB)")
    print(f"state_bytes(frozen by digest / copied) = {results['state_ratio']:.3f}x "
          f"({sizes['digest']['state_bytes'] / 1e6:.2f} MB / {sizes['copy']['state_bytes'] / 1e6:.2f} MB)")
    if args.json:
        print(f"wrote {write_results_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
