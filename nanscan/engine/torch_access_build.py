"""nanscan._torch_access compiled at first use for the running torch, where the installed package has none built for
it (NOTE: [first-use build]): a plain `pip install` builds nanscan where torch cannot be imported, so only
nanscan._C comes out of it. Cached per torch version; a failed build is recorded and not tried again."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

# NOTE: [first-use build]
# nanscan._torch_access reads tensors by torch's C++ object layout, so it must be compiled against the torch that
# runs it (NOTE: [tensor access] in csrc/torch/tensor_access.cpp). `make` installs nanscan without build isolation,
# after torch, and setup.py builds it then. `pip install nanscan` builds in an isolated environment where torch is
# not importable (and a torch named as a build requirement would be whichever one pip picked, not the user's), so
# the package carries the module's source instead (nanscan/_csrc; csrc/ beside an editable install) and the first
# lookup in a process where the module is missing, or built for another torch, compiles it for the running torch
# into a cache folder keyed by torch version and build, Python ABI, compiler, flags and source bytes: once per torch
# version, about 11 s on the 2-core development machine, announced in one line on stderr. A lock makes concurrent
# processes (the ranks of a job) wait for one build. A build that fails is recorded with its log and not tried again,
# so a machine whose compiler cannot build it pays one attempt; without a compiler nothing is tried. Either way the
# plan checks then read tensors through Python calls, which is slower but equivalent, and `nanscan info` says why.
# NANSCAN_BUILD_TORCH_ACCESS=0 turns the build off; NANSCAN_CACHE_DIR moves the cache (default ~/.cache/nanscan).
BUILD_ENV = "NANSCAN_BUILD_TORCH_ACCESS"
CACHE_ENV = "NANSCAN_CACHE_DIR"
SOURCE = "torch/tensor_access.cpp"
SOURCES = (SOURCE, "include/nanscan/tensor_access.h")  # what setup.py copies into nanscan/_csrc
MODULE = "nanscan._torch_access"

# setup.py's flags for the same module (_torch_access_extension), and the headers and libraries that torch's
# CppExtension adds (torch.utils.cpp_extension, not imported here: it imports setuptools, which a venv may lack).
_TORCH = Path(torch.__file__).resolve().parent
_INCLUDES = (_TORCH / "include", _TORCH / "include" / "torch" / "csrc" / "api" / "include")
_FLAGS = ("-shared", "-fPIC", "-O2", "-std=c++17", "-fvisibility=hidden", "-DNDEBUG")
_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")


def build_enabled() -> bool:
    return os.environ.get(BUILD_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def source_root() -> Path | None:
    """The folder holding SOURCES: nanscan/_csrc in an installed package, else the source tree's csrc/."""
    package = Path(__file__).resolve().parent.parent
    for root in (package / "_csrc", package.parent / "csrc"):
        if all((root / name).is_file() for name in SOURCES):
            return root
    return None


def compiler() -> list[str] | None:
    """The C++ compiler's command: $CXX (which may carry flags), else c++, g++ or clang++ on PATH."""
    if os.environ.get("CXX", "").strip():
        command = shlex.split(os.environ["CXX"])
        return command if shutil.which(command[0]) else None
    found = next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)
    return [found] if found else None


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanscan"


def compile_command(cxx: list[str], root: Path, output: Path) -> list[str]:
    includes = [root / "include", *_INCLUDES, sysconfig.get_paths()["include"]]
    return [*cxx, *_FLAGS, f'-DNANSCAN_TORCH_VERSION="{torch.__version__}"',
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *(f"-I{p}" for p in includes),
            str(root / SOURCE), "-o", str(output), f"-L{_TORCH / 'lib'}",
            *(f"-l{name}" for name in _LIBRARIES)]


def _folder(cxx: list[str], root: Path) -> Path:
    """The cache folder of this torch, Python and compiler: named by the torch version, keyed by all the inputs."""
    digest = hashlib.sha256("\0".join([torch.__version__, str(torch.version.git_version),
                                       str(torch._C._GLIBCXX_USE_CXX11_ABI), sysconfig.get_config_var("EXT_SUFFIX"),
                                       *cxx, *_FLAGS]).encode())
    for name in SOURCES:
        digest.update(b"\0" + (root / name).read_bytes())
    return cache_root() / "torch_access" / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _locked(folder: Path):
    """An exclusive lock on the folder (POSIX), held until the returned file is closed; without fcntl, no lock (the
    finished module is still renamed into place whole)."""
    handle = open(folder / "lock", "w")  # noqa: SIM115 - closed by the caller
    try:
        import fcntl  # noqa: PLC0415 - POSIX only

        fcntl.flock(handle, fcntl.LOCK_EX)
    except ImportError:
        pass
    return handle


def load_or_build() -> tuple[ModuleType | None, str]:
    """(the module, built for the running torch, and where it lies), or (None, why not): from the cache, else
    compiled there now (NOTE: [first-use build])."""
    if not build_enabled():
        return None, f"its build at first use is off ({BUILD_ENV}=0)"
    root = source_root()
    if root is None:
        return None, "its source is not installed with nanscan, so it cannot be built at first use"
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler was found to build it at first use (set CXX)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return None, "Python's C headers (Python.h), which its build at first use needs, are not installed"
    try:
        folder = _folder(cxx, root)
        folder.mkdir(parents=True, exist_ok=True)
        lock = _locked(folder)
    except OSError as exc:
        return None, f"its cache folder cannot be written ({exc}; set {CACHE_ENV})"
    with lock:
        module_path = folder / ("_torch_access" + sysconfig.get_config_var("EXT_SUFFIX"))
        log = folder / "failed.log"
        if not module_path.exists() and not log.exists():
            partial = folder / f"_torch_access.{os.getpid()}.tmp.so"  # renamed into place only when complete
            command = compile_command(cxx, root, partial)
            print(f"nanscan: building {MODULE} for torch {torch.__version__} (once per torch version, about 10 s; "
                  f"cached in {folder})", file=sys.stderr, flush=True)
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False)
                output = result.stdout + result.stderr
                built = result.returncode == 0
            except OSError as exc:
                output, built = str(exc), False
            if built:
                os.replace(partial, module_path)
            else:
                partial.unlink(missing_ok=True)
                log.write_text(shlex.join(command) + "\n\n" + output)
                print(f"nanscan: {MODULE} did not build (log: {log}); plan checks read tensors through Python",
                      file=sys.stderr, flush=True)
        if log.exists():
            return None, f"its build at first use failed (log: {log}; delete that file to try again)"
    try:
        module = _load(module_path)
    except ImportError as exc:
        return None, f"its build at first use ({module_path}) does not load ({exc})"
    if module.torch_version != torch.__version__:
        return None, f"its build at first use ({module_path}) is for torch {module.torch_version}"
    return module, f"built at first use for torch {module.torch_version}, {module_path}"
