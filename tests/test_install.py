"""What a plain `pip install` of nanscan gives (NOTE: [first-use build] in nanscan/engine/torch_access_build.py): built
where torch cannot be imported, as in pip's isolated build, the package carries the source of nanscan._torch_access,
and the first `nanscan info` in an environment with torch builds it for that torch, says so in one line, and reads
tensors through it; later processes take it from the cache; without a compiler the plan checks read through Python
and say why.

Offline and quick, so without pip's own isolated environment (which would download setuptools and pybind11): a fresh
venv without torch builds the checkout with `--no-build-isolation`, setuptools, wheel and pybind11 lent to it on
PYTHONPATH, and no compiler, so only the package's Python files and the copied source come out of it (this
checkout's nanscan._C stands in for the one a compiler would add: test_native_build.py builds that one through pip).
Torch is then lent to the new venv on PYTHONPATH from this one's site-packages."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import nanscan
from test_native_build import copy_source, no_compiler_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BUILD_TOOLS = {"setuptools": ("setuptools", "pkg_resources", "_distutils_hack"), "wheel": ("wheel",),
               "pybind11": ("pybind11",)}


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


def lend_build_tools(dest: Path) -> Path:
    """A folder of links to this environment's setuptools, wheel and pybind11 (packages and metadata), nothing else."""
    dest.mkdir()
    for dist_name, packages in BUILD_TOOLS.items():
        dist = importlib.metadata.distribution(dist_name)
        site = Path(dist.locate_file(""))
        for entry in [*packages, *(p.name for p in site.glob(f"{dist_name}-{dist.version}.dist-info"))]:
            if (site / entry).exists():
                (dest / entry).symlink_to(site / entry)
    return dest


def environment(**extra) -> dict[str, str]:
    """The environment of the new venv's processes: this one's site-packages lends torch; nothing of nanscan's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANSCAN_") and k not in ("PYTHONPATH", "CXX")}
    env.update(PYTHONPATH=sysconfig.get_paths()["purelib"], **extra)
    return env


@pytest.fixture(scope="module")
def pip_installed(tmp_path_factory) -> Path:
    """A new venv's python, nanscan installed in it by pip from a copy of the checkout, built where torch is not
    importable; this checkout's nanscan._C added."""
    native = sorted((ROOT / "nanscan").glob("_C.*.so"))
    if not native:
        pytest.skip("nanscan._C is not built here: without it nanscan never builds nanscan._torch_access")
    tmp = tmp_path_factory.mktemp("install")
    src = copy_source(tmp / "src")
    result = run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")])
    assert result.returncode == 0, result.stderr
    python = tmp / "venv" / "bin" / "python"
    env = no_compiler_env(PYTHONPATH=str(lend_build_tools(tmp / "build-tools")))
    result = run([python, "-c", "import torch"], env=env)
    assert result.returncode != 0, "torch is importable where the package is built"
    result = run([sys.executable, "-m", "pip", "--python", str(python), "install", "-v", "--no-build-isolation",
                  "--no-deps", "--no-index", str(src)], env=env, cwd=tmp)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nanscan builds it at first use for the torch that runs it" in result.stdout + result.stderr
    result = run([python, "-c", "import nanscan, pathlib; print(pathlib.Path(nanscan.__file__).parent)"],
                 env=environment(), cwd=tmp)
    assert result.returncode == 0, result.stderr
    package = Path(result.stdout.strip().splitlines()[-1])
    assert package.is_relative_to(tmp / "venv"), f"imported {package}, not the installed copy"
    assert not list(package.glob("_torch_access*")), "built where torch was not importable"
    assert (package / "_csrc" / "torch" / "tensor_access.cpp").is_file()
    assert (package / "_csrc" / "include" / "nanscan" / "tensor_access.h").is_file()
    shutil.copy2(native[0], package / native[0].name)
    return python


def plan_check_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("plan checks read tensors"))


CHECK = """
import torch
import nanscan
from nanscan.engine.plans import ModelScanPlan
assert ModelScanPlan()._tensor_access is not None
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
mon = nanscan.Monitor(model, optimizer, bundle_dir={bundles!r}, mode="sync", backend="cpu")
for step in range(3):
    loss = model(torch.randn(2, 8)).square().mean()
    loss.backward()
    mon.check(loss=loss)
    optimizer.step()
    optimizer.zero_grad()
print(nanscan.__file__)
"""


def test_the_first_use_builds_it_once_for_the_running_torch(pip_installed, tmp_path):
    cache = tmp_path / "cache"
    result = run([pip_installed, "-m", "nanscan", "info"], env=environment(NANSCAN_CACHE_DIR=str(cache)),
                 cwd=tmp_path)
    line = plan_check_line(result)
    assert line.startswith("plan checks read tensors through torch's C++ headers (nanscan._torch_access, built at "
                           f"first use for torch {torch.__version__}, {cache}"), line
    building = [x for x in result.stderr.splitlines() if "building nanscan._torch_access" in x]
    assert building == [f"nanscan: building nanscan._torch_access for torch {torch.__version__} (once per torch "
                        f"version, about 10 s; cached in {next((cache / 'torch_access').iterdir())})"]

    # Another process: from the cache, nothing built, and the Monitor's plan checks read through it.
    result = run([pip_installed, "-c", CHECK.format(bundles=str(tmp_path / "bundles"))],
                 env=environment(NANSCAN_CACHE_DIR=str(cache)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "building" not in result.stderr
    assert Path(result.stdout.strip().splitlines()[-1]).is_relative_to(pip_installed.parent.parent)
    assert len(list((cache / "torch_access").iterdir())) == 1


def test_without_a_compiler_the_plan_checks_read_through_python_and_say_why(pip_installed, tmp_path):
    env = environment(NANSCAN_CACHE_DIR=str(tmp_path / "cache"), CXX=str(tmp_path / "no-such-compiler"))
    line = plan_check_line(run([pip_installed, "-m", "nanscan", "info"], env=env, cwd=tmp_path))
    assert line.startswith("plan checks read tensors through Python calls: nanscan._torch_access is not available")
    assert line.endswith("and no C++ compiler was found to build it at first use (set CXX)")


def test_a_failed_build_is_not_tried_again(pip_installed, tmp_path):
    env = environment(NANSCAN_CACHE_DIR=str(tmp_path / "cache"), CXX=shutil.which("false") or "false")
    first = run([pip_installed, "-m", "nanscan", "info"], env=env, cwd=tmp_path)
    assert "did not build (log: " in first.stderr
    line = plan_check_line(first)
    assert "its build at first use failed (log: " in line
    again = run([pip_installed, "-m", "nanscan", "info"], env=env, cwd=tmp_path)
    assert "building" not in again.stderr
    assert plan_check_line(again) == line


def test_the_suite_itself_never_builds_it():
    """tests/conftest.py turns the build off: the suite checks the module that `make` built beside the package."""
    assert os.environ["NANSCAN_BUILD_TORCH_ACCESS"] == "0"
    assert nanscan.backend_info()["tensor_reads"].startswith("through torch's C++ headers (nanscan._torch_access, "
                                                              "built for torch")
