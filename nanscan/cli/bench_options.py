"""How fast is a scan? nanscan's CPU backends against the machine's read limit and against the per-tensor torch
checks used instead, on a GPT-2-small-shaped set of float32 parameters and gradients (about 124M of each, ~300
tensors, ~1 GB), all measured in one run; then the same set in bfloat16 and in float16 (gradients loss-scaled),
against the read limit and the isfinite loop, and ~0.5 GB sets of float8_e4m3fn and float8_e5m2 tensors, against
the read limit and a per-tensor `t.float().isfinite()` loop (extra ratio lines, each prefixed with its dtype).

The paragraph above is the scan benchmark's --help, and this module its arguments (`nanscan bench`,
benchmarks/bench_scan.py). nanscan.bench_scan measures, and imports torch to do it; parsing the arguments here
first lets --help and a wrong argument answer at once (NOTE: [fast help] in nanscan/cli/main.py).
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanscan bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink every tensor by this factor (default 1.0: ~1 GB; 0.1 for a quick run)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per method (default 7)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH (atomically)")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 4:
        parser.error(f"--scale must be in (0, 4], got {args.scale}")
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    return args
