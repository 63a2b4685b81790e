"""How fast is a scan? nanscan's CPU backends against the machine's read limit and the per-tensor torch checks,
on GPT-2-small-shaped tensors: a table, ratio lines and, with --json, a results file. The benchmark lives in
nanscan/bench_scan.py (also `nanscan bench`); run it alone:

    flock /tmp/nanscan-bench.lock .venv/bin/python benchmarks/bench_scan.py --json benchmarks/results/bench_scan.json
"""

import sys

from nanscan.bench_scan import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
