"""Does the ablation over the window name the right cause, and does it call a delay or a wrecked loss a fix? Both
errors counted on karpathy's nanoGPT train.py loop as it is (tests/karpathy_train.py), with a replay entry that
declares neither its clipping nor its loss scaling, on failures the project's other tests do not drive this way:

    case                 failing step  confirmed            verified by the real run
    ...
    right_causes = <n> of <m>            (a factor the real run confirms is among the confirmed, or none exists)
    false_confirmations = <k> of <c>     (a confirmed factor that, applied to the real loop from the start for three
                                          times the failing step's iterations, goes non-finite or ends with its loss
                                          above twice its first: a delay or a wrecked loss called a fix)

Each confirmed factor is checked by running the loop itself with it (learning rate scaled, a longer warm-up,
another dtype) from iteration 0, and the strongest single-factor fixes are checked the same way to know whether
a right cause existed. Run it alone: `.venv/bin/python benchmarks/bench_window_causes.py --json
benchmarks/results/bench_window_causes.json` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure this checkout, whatever is installed
sys.path.insert(0, str(ROOT / "tests"))

import karpathy_train as K  # noqa: E402

from nanscan.replay.ablate_window import ablate_window  # noqa: E402
from nanscan.runtime.window import Window  # noqa: E402

# (name, the loop's overrides, train() options, what the failure is)
CASES = (
    ("lr30-float32", K.LR30, {}, "a learning rate too large (30, a 10-step warm-up)"),
    ("lr30-bf16", {**K.LR30, "dtype": "bfloat16"}, {}, "the same under bf16 autocast"),
    ("lr30-summed", K.LR30, {"sum_losses": True}, "the same with the micro-batch losses summed"),
    ("lr5-fp16", {**K.LR30, "learning_rate": 5.0, "dtype": "float16"}, {},
     "a learning rate too large (5) under float16 autocast and the loop's GradScaler, skipping overflowed steps"),
    ("naive-log-softmax", {"learning_rate": 1.5, "naive_loss": True}, {},
     "a code bug: log(softmax) underflows to log(0); with F.cross_entropy the same rate trains"),
)
RECOVERED = 2.0  # the real run's final loss at most this times its first (nanscan.runtime.window_ablation.LOSS_BAND)


def factor_overrides(key: str, config: dict) -> dict | None:
    """The loop's own setting that a factor stands for, or None where the loop has none to change."""
    c = K.full_config(config)
    if key.startswith("lr-x"):
        return {"learning_rate": c["learning_rate"] * float(key[4:])}
    if key == "warmup-x2":
        return {"warmup_iters": 2 * c["warmup_iters"]}
    if key == "fp32":
        return {"dtype": "float32"}
    if key == "bf16-autocast":
        return {"dtype": "bfloat16"}
    if key == "naive-fixed":
        return {"naive_loss": False}
    return None


def real_run(config: dict, options: dict, iters: int) -> tuple[bool, str]:
    """Run the loop itself (no Monitor) for `iters` iterations: (fixed, why)."""
    run = K.train({**config, "max_iters": iters}, None, monitor=False, **options)
    if run.truth is not None:
        return False, f"non-finite at {run.truth}"
    tail = sorted(run.losses[-10:])
    ended = tail[len(tail) // 2]
    if ended > RECOVERED * run.losses[0]:
        return False, f"finite, loss {ended:.3g} against {run.losses[0]:.3g} at the start"
    return True, f"finite for {iters}, loss {ended:.3g} against {run.losses[0]:.3g}"


def judge(name: str, config: dict, options: dict, what: str, root: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = K.train(config, root / name, window=Window(steps=32, every=8), **options)
        started = time.perf_counter()
        result = ablate_window(run.bundle, K.ENTRY)
        seconds = time.perf_counter() - started
    iters = max(120, 3 * run.nonfinite_step)
    confirmed = {}
    for row in result.fixes:
        overrides = factor_overrides(row.factor.key, config)
        confirmed[row.factor.key] = real_run({**config, **overrides}, options, iters) if overrides is not None \
            else (None, "the loop has no such setting to check")
    # whether a right cause existed among what the loop can change: the ladder's rates, the fixed code
    candidates = ["lr-x0.5", "lr-x0.1", "lr-x0.01"] + (["naive-fixed"] if config.get("naive_loss") else [])
    true_fixes = [key for key in candidates
                  if real_run({**config, **factor_overrides(key, config)}, options, iters)[0]]
    false = [key for key, (fixed, _) in confirmed.items() if fixed is False]
    # right: a confirmed factor the real run confirms, or nothing confirmed where no rate the ladder tries fixes it
    right = any(fixed for fixed, _ in confirmed.values()) if confirmed else \
        not [key for key in true_fixes if key.startswith("lr-")]
    return {"case": name, "what": what, "failing_step": run.nonfinite_step, "ablation_s": seconds,
            "rows": {r.factor.key: r.verdict for r in result.rows},
            "confirmed": {k: {"fixed": v[0], "why": v[1]} for k, v in confirmed.items()},
            "true_fixes": true_fixes, "false_confirmations": false, "right_cause": right}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, options, what in CASES:
            rows.append(judge(name, config, options, what, Path(tmp)))
            r = rows[-1]
            print(f"{name:18s} step {r['failing_step']:>3}  confirmed {list(r['confirmed']) or '-'}  "
                  f"real-run fixes {r['true_fixes'] or '-'}  false {r['false_confirmations'] or '-'}  "
                  f"({r['ablation_s']:.1f} s)", flush=True)
            for key, verdict in r["rows"].items():
                print(f"    {key:16s} {verdict}")
    confirmations = sum(len(r["confirmed"]) for r in rows)
    false = sum(len(r["false_confirmations"]) for r in rows)
    right = sum(r["right_cause"] for r in rows)
    print(f"right_causes = {right} of {len(rows)}")
    print(f"false_confirmations = {false} of {confirmations}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cases": rows, "right_causes": right, "false_confirmations": false,
                                         "confirmations": confirmations}, indent=2))


if __name__ == "__main__":
    main()
