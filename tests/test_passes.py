"""The suite's two passes (NOTE: [two passes] in tests/two_passes.py): every test module is placed in exactly one of
the two lists, with its reason; `make test`'s numba pass leaves out what is marked `once`; and collection marks it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from two_passes import BOTH_PASSES, NATIVE_PASS_ONLY

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_every_test_module_is_in_exactly_one_list():
    modules = {path.stem for path in TESTS.glob("test_*.py")}
    assert not set(BOTH_PASSES) & set(NATIVE_PASS_ONLY), "a module in both lists"
    unplaced = sorted(modules - set(BOTH_PASSES) - set(NATIVE_PASS_ONLY))
    assert unplaced == [], f"add these to BOTH_PASSES or NATIVE_PASS_ONLY in tests/two_passes.py: {unplaced}"
    assert sorted((set(BOTH_PASSES) | set(NATIVE_PASS_ONLY)) - modules) == [], "a listed module does not exist"
    assert all(reason.strip() for reason in [*BOTH_PASSES.values(), *NATIVE_PASS_ONLY.values()])


def test_the_numba_pass_leaves_out_what_is_marked_once():
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("once:") for marker in markers)
    makefile = (ROOT / "Makefile").read_text()

    def runs(target: str) -> list[str]:
        lines = makefile.split(f"\n{target}: ", 1)[1].split("\n\n", 1)[0].splitlines()
        return [line.strip() for line in lines if "pytest" in line]

    # make test and make test-slow split the suite by `slow`, each in both passes; CI runs both
    assert runs("test") == ['$(PY) -m pytest -q -m "not slow"',
                            'NANSCAN_BACKEND=numba $(PY) -m pytest -q -m "not once and not slow"']
    assert runs("test-slow") == ['$(PY) -m pytest -q -m slow',
                                 'NANSCAN_BACKEND=numba $(PY) -m pytest -q -m "slow and not once"']
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and any(line.startswith("make test-slow") for line in ci)


def test_collection_marks_the_native_pass_only_modules(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not once",
         "tests/test_runs.py", "tests/test_backends.py"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/test_backends.py::") for line in collected), result.stdout
    assert "deselected" in result.stdout
