"""What the in-process diagnosis (Monitor(step_fn=...), NOTE: [in-process diagnosis]) costs at the incident, in
seconds and in the run's own training steps, on the demo's model and on GPT-2-small's shapes:

    case          params  step_s  diagnosis_s  steps_rerun  = training steps  verdict
    demo          ...
    gpt2-small    ...

`steps_rerun` counts every step the diagnosis ran (the unchanged window, then each factor over the window and past
the failing step); `= training steps` is diagnosis_s / step_s, the number that carries to another machine (a
rerun step is a training step: a forward, a backward and an optimizer step, plus a scan). The diagnosis runs once,
at the incident, so it costs nothing per step; its bound is `diagnose_timeout` (300 s by default).

- demo: `nanscan demo`'s model and data (its record whose loss weights are float32's maximum, at step 80), the demo's
  loop with `step_fn=nanscan.demo.step_fn` and the default window (32 steps).
- gpt2-small: karpathy's nanoGPT `train.py` loop (tests/karpathy_train.py) at GPT-2 small's shapes (12 layers, 12
  heads, 768 wide, vocabulary 50304; 124M parameters, tied), 2 micro-batches of 1 x 64 tokens on the CPU, learning
  rate 30 with a 2-step warm-up, a window of 8 steps kept every 4.

Run it alone: `.venv/bin/python benchmarks/bench_diagnosis.py --json benchmarks/results/bench_diagnosis.json`
(about 8 minutes on 2 cores; `--cases demo` for the first alone).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure this checkout, whatever is installed
sys.path.insert(0, str(ROOT / "tests"))

import karpathy_train as K  # noqa: E402

from nanscan import demo as D  # noqa: E402
from nanscan.incident import NonFiniteError  # noqa: E402
from nanscan.runtime.monitor import Monitor  # noqa: E402
from nanscan.runtime.window import Window  # noqa: E402

GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50304, "block_size": 64, "batch_size": 1,
              "gradient_accumulation_steps": 2, "learning_rate": 30.0, "warmup_iters": 2, "max_iters": 40}


def steps_rerun(ablation) -> int:
    """Every step the diagnosis ran: each row's window rerun and its steps past the failing step."""
    rows = [ablation.baseline, *ablation.rows]
    return sum(len(r.window.steps) + r.beyond_run for r in rows if r.window is not None)


def result_of(name: str, model: torch.nn.Module, step_seconds: list[float], monitor: Monitor, step: int) -> dict:
    diagnosis = monitor.diagnosis
    if diagnosis is None or diagnosis.ablation is None:
        raise SystemExit(f"{name}: the diagnosis did not run: "
                         f"{diagnosis.headline() if diagnosis else 'no incident reached it'}")
    step_s = sorted(step_seconds)[len(step_seconds) // 2]  # the median: the first steps warm caches up
    rerun = steps_rerun(diagnosis.ablation)
    return {"case": name, "params": sum(p.numel() for p in model.parameters()), "failing_step": step,
            "step_s": round(step_s, 4), "diagnosis_s": round(diagnosis.seconds, 2), "steps_rerun": rerun,
            "training_steps": round(diagnosis.seconds / step_s, 1),
            "seconds_per_rerun_step": round(diagnosis.seconds / max(rerun, 1), 4),
            "rows": {r.factor.key: r.verdict for r in diagnosis.ablation.rows},
            "headline": diagnosis.headline(), "timed_out": diagnosis.timed_out}


def demo_case(workdir: Path) -> dict:
    """The demo's detect loop, timed per step, with step_fn and the default window."""
    config = D.demo_config(workdir)
    records = D.make_records(config)
    D.plant_fault(records, config)
    D.write_dataset(Path(config["data_path"]), records)
    step_seconds: list[float] = []
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
        optimizer = D.build_optimizer(model, config)
        dataset = D.TokenRecords(config["data_path"], config["seq_len"])
        monitor = Monitor(model, optimizer, bundle_dir=workdir / "bundles", config=config, run_id="bench-demo",
                          step_fn=D.step_fn)
        with monitor:
            for step, (batch, ids) in enumerate(D.batches(dataset, config)):
                start = time.perf_counter()
                for group in optimizer.param_groups:
                    group["lr"] = D.lr_at(step, config)
                optimizer.zero_grad(set_to_none=True)
                loss = D.step_fn(model, batch)
                loss.backward()
                try:
                    monitor.check(batch=batch, loss=loss, sample_ids=ids, step=step)
                except NonFiniteError as exc:
                    return result_of("demo", model, step_seconds, monitor, exc.step)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
                optimizer.step()
                step_seconds.append(time.perf_counter() - start)
    raise SystemExit("demo: the planted record was not reached")


def cheap_stream(c: dict, split: str) -> torch.Tensor:
    """train.py's token file for a 50304-token vocabulary (tests/karpathy_train.py's Markov table would be 10 GB)."""
    g = torch.Generator().manual_seed(c["seed"] + (0 if split == "train" else 1))
    return torch.randint(c["vocab_size"], (4096,), generator=g)


def gpt2_case(workdir: Path) -> dict:
    """train.py's loop at GPT-2 small's shapes; its per-iteration time from the loop's own losses' timestamps."""
    K.token_stream = cheap_stream
    stamps: list[float] = []
    original_check = Monitor.check

    def timed_check(self, *args, **kwargs):  # one stamp per iteration, at its check
        stamps.append(time.perf_counter())
        return original_check(self, *args, **kwargs)

    Monitor.check = timed_check
    try:
        run = K.train(GPT2_SMALL, workdir, window=Window(steps=8, every=4), step_fn=K.forward_loss)
    finally:
        Monitor.check = original_check
    if run.error is None:
        raise SystemExit(f"gpt2-small: no incident in {GPT2_SMALL['max_iters']} iterations")
    step_seconds = [b - a for a, b in zip(stamps, stamps[1:])]
    return result_of("gpt2-small", run.monitor.model, step_seconds, run.monitor, run.nonfinite_step)


CASES = {"demo": demo_case, "gpt2-small": gpt2_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    results = []
    print(f"{'case':<12}{'params':>12}{'step_s':>9}{'diagnosis_s':>13}{'steps_rerun':>13}{'= steps':>9}  verdict")
    for name in args.cases:
        with tempfile.TemporaryDirectory() as tmp:
            r = CASES[name](Path(tmp))
        results.append(r)
        print(f"{r['case']:<12}{r['params']:>12,}{r['step_s']:>9.3f}{r['diagnosis_s']:>13.1f}{r['steps_rerun']:>13}"
              f"{r['training_steps']:>9.0f}  {r['headline']}")
        print("             rows: " + ", ".join(f"{k} {v}" for k, v in r["rows"].items()))
    if args.json:
        payload = {"measured_on": {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
                                   platform.machine(), "cores": torch.get_num_threads(), "torch": torch.__version__},
                   "cases": results}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
