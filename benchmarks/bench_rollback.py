"""What on_invalid=Rollback() leaves of a run (NOTE: [rollback], [recovered]), against the same run without the
fault: karpathy's nanoGPT `train.py` loop over 512 records drawn with `torch.randint` on torch's global generator
(tests/test_rollback_data.py: 2 micro-batches, `loss / 2`, the prefetch before backward, clipping at 1.0, two AdamW
groups, a check after each micro-batch, optimizer.step() whatever the check said), 200 iterations (each record drawn
about 3 times), the final loss on 64 windows of the records' token stream:

    case                       policy           final loss  vs clean   rollbacks  outcome
    clean (seeds 7, 8, 9)      none             ...         noise
    one bad micro-batch (60)   Rollback()       ...
    ...

- clean: the run without a fault, at three seeds (model init and draws): the seed noise a fix must stay within.
- one bad micro-batch: iteration 60's first micro-batch has NaN loss weights in every row (a batch corrupted on its
  way, not its records), under the default Rollback(), skip="window" and on_invalid="skip". Every row held a NaN,
  so the rollback quarantines the batch's 4 records, and the later steps that draw one of them are dropped too.
- corrupt record: one record's loss weights are NaN, drawn again and again by the sampler (with replacement);
  without nanscan the run goes NaN; with the default Rollback() it is quarantined at its first draw and every later
  step that draws it is dropped.
- lr 30: a learning rate 3000x the clean run's (a window of 64 steps, to reach back before its growth), with
  Rollback(lr_scale=0.5) and lr_scale=1e-3: which is called recovered?

Run it alone: `.venv/bin/python benchmarks/bench_rollback.py --json benchmarks/results/bench_rollback.json`
(about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # measure this checkout, whatever is installed
sys.path.insert(0, str(ROOT / "tests"))

import karpathy_train as K  # noqa: E402
import test_rollback_data as D  # noqa: E402
from nanscan import Rollback  # noqa: E402
from nanscan.runtime.window import Window  # noqa: E402

ITERS = 200
RECORDS = 512  # records drawn about 3 times each in 200 iterations: a dataset, not a handful memorized
CLEAN_SEEDS = (7, 8, 9)
BAD_RECORD = "rec-5"


def shown(policy) -> str:
    """A policy as the table names it: a Rollback by the settings that differ from Rollback()'s."""
    if not isinstance(policy, Rollback):
        return str(policy)
    changed = [f"{f.name}={getattr(policy, f.name)!r}" for f in dataclasses.fields(policy)
               if getattr(policy, f.name) != getattr(Rollback(), f.name)]
    return f"Rollback({', '.join(changed)})"


def case(name: str, policy, *, seed: int = D.SEED, bad: str | None = None, poison=None, config=None,
         window=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = D.run(Path(tmp), bad, policy, iters=ITERS, seed=seed, poison=poison,
                           config=config or D.CONFIG, window=window, count=RECORDS)
        except Exception as exc:  # noqa: BLE001 - a run that stopped is a result too
            why = str(exc).split("; on_invalid=Rollback: ")[-1].split("; the bundles")[0]
            return {"case": name, "policy": shown(policy), "seed": seed, "stopped": f"{type(exc).__name__}: {why}"}
        rollbacks = []
        path = Path(tmp) / "records" / "rollbacks.json"
        if path.exists():
            rollbacks = json.loads(path.read_text())["rollbacks"]
        held = [it for it, ids in enumerate(result.drawn) if bad is not None and bad in ids]
        return {"case": name, "policy": shown(policy), "seed": seed,
                "final_loss": D.stream_loss(result.model), "finite": result.finite,
                "rollbacks": [{"at_step": r["at_step"], "skip": r["skip"], "skipped_steps": len(r["skipped_steps"]),
                               "outcome": r["outcome"]["status"], "why": r["outcome"].get("why")}
                              for r in rollbacks],
                "draws_of_bad_record": len(held), "updates_dropped": len(result.unchanged)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    rows = [case(f"clean (seed {s})", None, seed=s) for s in CLEAN_SEEDS]
    rows += [case("one bad micro-batch at iteration 60", policy, poison=(60, 0))
             for policy in (Rollback(), Rollback(skip="window"), "skip")]
    rows += [case("corrupt record drawn again and again", policy, bad=BAD_RECORD) for policy in (None, Rollback())]
    lr30 = K.full_config({"learning_rate": 30.0, "warmup_iters": 10})
    rows += [case("lr 30", policy, config=lr30, window=Window(steps=64, every=8))
             for policy in (None, Rollback(lr_scale=0.5, factor_steps=1000),
                            Rollback(lr_scale=1e-3, factor_steps=1000))]
    clean = [r["final_loss"] for r in rows[:len(CLEAN_SEEDS)]]
    reference = clean[0]  # the same seed as every faulted run
    for r in rows:
        if "final_loss" in r and math.isfinite(r["final_loss"]):
            r["vs_clean_pct"] = 100.0 * (r["final_loss"] / reference - 1.0)
    noise = [100.0 * (c / reference - 1.0) for c in clean]
    print(f"seed noise on the final loss: {min(noise):+.2f}% .. {max(noise):+.2f}% (seeds {CLEAN_SEEDS})")
    print(f"{'case':36} {'policy':42} {'final':>9} {'vs clean':>9}  outcome")
    for r in rows:
        outcome = "; ".join(f"step {x['at_step']} skip={x['skip']} ({x['skipped_steps']} skipped): {x['outcome']}"
                            for x in r.get("rollbacks", [])) or r.get("stopped", "")
        vs = f"{r['vs_clean_pct']:+.2f}%" if "vs_clean_pct" in r else "n/a"
        print(f"{r['case']:36} {r['policy']:42} {r.get('final_loss', float('nan')):9.4f} {vs:>9}  {outcome}")
    if args.json:
        payload = {"measured_on": {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
                                   platform.machine(), "torch": torch.__version__, "threads": 2},
                   "iters": ITERS, "seed_noise_pct": [min(noise), max(noise)], "rows": rows,
                   "seconds": time.perf_counter() - start}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
