"""Where a run came from: the source version (git commit, dirty flag, diff hash), the software and hardware
environment, a stable hash of the configuration, and the random number generator states needed to replay a step.

Everything here is captured cheaply and returned as plain JSON-ready dicts (plus tensors for the RNG states), so
the bundle can store it without pickle.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
from pathlib import Path, PurePath
from typing import Any, Mapping

import numpy as np
import torch

# A diff larger than this is hashed but not stored in the bundle (the hash still pins the exact source).
MAX_STORED_DIFF_BYTES = 4 << 20
_GIT_TIMEOUT_S = 10


# -- source version -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """The code that ran: a git commit plus the hash (and, when small enough, the text) of uncommitted changes,
    or a package version when the code is not in a git work tree."""

    fields: dict
    diff: bytes | None = None  # `git diff HEAD` output, kept only when dirty and at most MAX_STORED_DIFF_BYTES

    def to_dict(self) -> dict:
        return dict(self.fields)


def _git(directory: Path, *args: str) -> bytes:
    # GIT_OPTIONAL_LOCKS=0: `git status` must not take index.lock in a tree where others may be committing.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    return subprocess.run(["git", "-C", str(directory), *args], check=True, capture_output=True, env=env,
                          timeout=_GIT_TIMEOUT_S).stdout


def default_source_directory() -> Path:
    """The directory of the running script (`__main__.__file__`), else the current directory."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        return Path(main_file).resolve().parent
    return Path.cwd()


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - cheap, but only needed here

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=16)
def _capture_source(directory: Path) -> SourceInfo:
    nanscan_version = package_version("nanscan")
    try:
        root = _git(directory, "rev-parse", "--show-toplevel").decode().strip()
    except (OSError, subprocess.SubprocessError) as exc:
        reason = ("git is not installed" if isinstance(exc, FileNotFoundError)
                  else f"{directory} is not in a git work tree")
        return SourceInfo({"kind": "package", "directory": str(directory), "reason": reason,
                           "nanscan_version": nanscan_version})
    try:
        commit = _git(directory, "rev-parse", "--verify", "HEAD").decode().strip()
    except (OSError, subprocess.SubprocessError):
        commit = None  # a repository without any commit yet
    try:
        status = _git(directory, "status", "--porcelain", "--untracked-files=normal").decode(errors="replace")
        changed = [line for line in status.splitlines() if line and not line.startswith("??")]
        untracked = [line for line in status.splitlines() if line.startswith("??")]
        diff = _git(directory, "diff", "HEAD", "--binary") if commit is not None and changed else b""
    except (OSError, subprocess.SubprocessError) as exc:
        return SourceInfo({"kind": "git", "directory": str(directory), "root": root, "commit": commit,
                           "dirty": None, "error": f"git status/diff failed: {exc}",
                           "nanscan_version": nanscan_version})
    fields = {
        "kind": "git", "directory": str(directory), "root": root, "commit": commit,
        "dirty": bool(changed or untracked), "changed_files": len(changed), "untracked_files": len(untracked),
        "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None, "diff_bytes": len(diff),
        "nanscan_version": nanscan_version,
    }
    stored = diff if diff and len(diff) <= MAX_STORED_DIFF_BYTES else None
    return SourceInfo(fields, stored)


def capture_source(directory: str | os.PathLike | None = None) -> SourceInfo:
    """The source version of the code in `directory` (default: the running script's directory).

    Cached per directory for the life of the process: the code that runs is the code that was imported, so a
    later edit of the work tree must not change what a bundle records.
    """
    return _capture_source(Path(directory).resolve() if directory is not None else default_source_directory())


# -- environment --------------------------------------------------------------------------------------------

def environment(backends: str | None = None) -> dict:
    """Versions, devices and the determinism-relevant flags of this process, as JSON-ready values."""
    cuda = torch.cuda.is_available()
    devices = [platform.processor() or platform.machine() or "cpu"]
    if cuda:
        devices += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cudnn = torch.backends.cudnn
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "nanscan": package_version("nanscan"),
        "safetensors": package_version("safetensors"),
        "backend": backends,
        "devices": devices,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cudnn_version": cudnn.version() if cudnn.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        # where the run imported from, so the CLI can import its replay entry the same way (nanscan.entry)
        "working_directory": os.getcwd(),
        "main_path": os.path.abspath(sys.path[0]) if sys.path else None,
        "deterministic": {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": bool(cudnn.deterministic),
            "cudnn_benchmark": bool(cudnn.benchmark),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"),
        },
    }


# -- configuration --------------------------------------------------------------------------------------------

class ConfigError(TypeError):
    """A configuration value that cannot be recorded as JSON."""


def normalize_config(config: Any) -> dict | None:
    """The configuration as a JSON-ready dict, checked now so a bad value fails at start-up, not at the incident.

    Accepts a mapping, a dataclass instance or an argparse.Namespace-like object (anything with __dict__).
    Inside, tuples become lists, paths and enums become their string/value, numpy scalars become numbers.
    """
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    elif not isinstance(config, Mapping) and hasattr(config, "__dict__"):
        config = vars(config)
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict, a dataclass or a namespace, got {type(config).__name__}")
    return _json_value(config, "config")


def _json_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where} is {value}: JSON cannot hold it; record it as a string (e.g. \"{value}\")")
        return value
    if isinstance(value, enum.Enum):
        return _json_value(value.value, where)
    if isinstance(value, np.generic):
        return _json_value(value.item(), where)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ConfigError(f"{where} has a key of type {type(key).__name__}; use string keys")
            out[str(key)] = _json_value(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_json_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _json_value(dataclasses.asdict(value), where)
    raise ConfigError(f"{where} is a {type(value).__name__}, which cannot be recorded as JSON; "
                      "pass plain values (numbers, strings, lists, dicts) in the config")


def canonical_json(value: Any) -> bytes:
    """One byte string per JSON value (sorted keys, no spaces), so equal configs hash equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def config_sha256(config: dict | None) -> str | None:
    return None if config is None else hashlib.sha256(canonical_json(config)).hexdigest()


# -- random number generators ---------------------------------------------------------------------------------

RNG_SOURCES = ("torch", "numpy", "python")


def capture_rng(sources: tuple[str, ...] = RNG_SOURCES) -> dict:
    """The state of the RNGs a training step may draw from: "torch" (the CPU generator and each CUDA device's,
    the latter only if CUDA is already initialised so a CPU job never starts it), "numpy" (the global
    RandomState) and "python" (`random`).

    torch's states are cheap to copy (about 5 us); numpy's and Python's legacy state APIs cost about 150 us and
    30 us, which is why the Monitor takes them at every step start only when asked for exact snapshots.
    """
    state: dict = {}
    if "torch" in sources:
        state["torch_cpu"] = torch.get_rng_state()
        state["torch_cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    if "numpy" in sources:
        state["numpy"] = np.random.get_state()
    if "python" in sources:
        state["python"] = random.getstate()
    return state


_MT19937_WORDS = 624  # numpy's and Python's Mersenne Twister keys


def _rng_state_problems(state: dict) -> list[str]:
    """What in an RNG state (from a bundle, so possibly damaged) the generators would refuse, checked before any
    generator is touched so a bad state never leaves them half restored."""
    problems = []
    cpu = state.get("torch_cpu")
    expected = torch.get_rng_state().numel()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.shape != (expected,):
        shape = tuple(cpu.shape) if isinstance(cpu, torch.Tensor) else type(cpu).__name__
        problems.append(f"torch_cpu is {shape}, this torch's generator state is {expected} bytes")
    numpy_state = state.get("numpy")
    try:
        numpy_ok = (isinstance(numpy_state, tuple) and len(numpy_state) == 5 and numpy_state[0] == "MT19937"
                    and len(numpy_state[1]) == _MT19937_WORDS and 0 <= int(numpy_state[2]) <= _MT19937_WORDS)
    except (TypeError, ValueError):
        numpy_ok = False
    if not numpy_ok:
        problems.append("numpy is not an MT19937 state (algorithm, 624 keys, position, has_gauss, gaussian)")
    python_state = state.get("python")
    if (not isinstance(python_state, tuple) or len(python_state) != 3 or not isinstance(python_state[1], tuple)
            or len(python_state[1]) != _MT19937_WORDS + 1):
        problems.append("python is not a random.getstate() tuple (version, 625 integers, gauss_next)")
    return problems


def restore_rng(state: dict) -> None:
    """Put back the RNG states from capture_rng (or from a bundle). CUDA states are restored when this process
    has at least as many CUDA devices as were recorded. Raises ValueError, changing no generator, for a state
    that is damaged or was recorded by another torch version."""
    problems = _rng_state_problems(state)
    if problems:
        raise ValueError(f"cannot restore the recorded RNG state: {'; '.join(problems)} (a damaged bundle, or one "
                         "recorded by another torch version: replay with that version)")
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda") or []
    if cuda_states:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda_states):
            raise RuntimeError(f"the recorded RNG state covers {len(cuda_states)} CUDA device(s), but this process "
                               f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}; "
                               "restore on a machine with as many GPUs, or drop state['torch_cuda']")
        torch.cuda.set_rng_state_all(cuda_states)
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def restore_rng_sources(state: dict) -> None:
    """Put back the sources `state` holds (a step start's torch generators, which the Monitor takes every step) and
    leave the others as they are now."""
    restore_rng({**capture_rng(), **state})


def rng_to_tensors(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an RNG state into tensors (for safetensors) and a small JSON-ready dict."""
    algorithm, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    version, internal, gauss_next = state["python"]
    tensors = {
        "torch_cpu": state["torch_cpu"].detach().cpu().clone(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "python_state": torch.tensor(internal, dtype=torch.int64),
    }
    for i, cuda_state in enumerate(state.get("torch_cuda") or []):
        tensors[f"torch_cuda.{i}"] = cuda_state.detach().cpu().clone()
    meta = {
        "torch_cuda_devices": len(state.get("torch_cuda") or []),
        "numpy": {"algorithm": algorithm, "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "python": {"version": int(version), "gauss_next": gauss_next},
    }
    return tensors, meta


def rng_from_tensors(tensors: Mapping[str, torch.Tensor], meta: Mapping) -> dict:
    """Inverse of rng_to_tensors."""
    numpy_meta, python_meta = meta["numpy"], meta["python"]
    return {
        "torch_cpu": tensors["torch_cpu"].clone(),
        "torch_cuda": [tensors[f"torch_cuda.{i}"].clone() for i in range(int(meta["torch_cuda_devices"]))],
        "numpy": (numpy_meta["algorithm"], tensors["numpy_keys"].numpy().astype(np.uint32), numpy_meta["pos"],
                  numpy_meta["has_gauss"], numpy_meta["cached_gaussian"]),
        "python": (python_meta["version"], tuple(int(v) for v in tensors["python_state"].tolist()),
                   python_meta["gauss_next"]),
    }
