"""Provenance: git source version and dirty-diff hash, environment record, config normalisation and hashing,
RNG capture and restore (also through safetensors), and the atomic write helpers the bundle relies on."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from nanscan import _atomic
from nanscan.bundle import provenance
from nanscan.bundle.provenance import (ConfigError, capture_rng, config_sha256, normalize_config, restore_rng,
                                       rng_from_tensors, rng_to_tensors)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "train.py").write_text("print('v1')\n")
    _git(root, "add", "train.py")
    _git(root, "commit", "-q", "-m", "first")
    provenance._capture_source.cache_clear()
    yield root
    provenance._capture_source.cache_clear()


def test_clean_git_tree(repo):
    info = provenance.capture_source(repo).to_dict()
    assert info["kind"] == "git" and info["commit"] == _git(repo, "rev-parse", "HEAD").strip()
    assert info["dirty"] is False and info["diff_sha256"] is None
    assert provenance.capture_source(repo).diff is None


def test_dirty_git_tree_hashes_and_keeps_the_diff(repo):
    (repo / "train.py").write_text("print('v2')\n")
    (repo / "notes.txt").write_text("untracked\n")
    source = provenance.capture_source(repo / ".")
    info = source.to_dict()
    expected = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary"], check=True,
                              capture_output=True).stdout
    assert info["dirty"] is True and info["changed_files"] == 1 and info["untracked_files"] == 1
    assert info["diff_sha256"] == hashlib.sha256(expected).hexdigest() and source.diff == expected
    (repo / "train.py").write_text("print('v3')\n")
    assert provenance.capture_source(repo).diff == expected  # cached: the code that was imported is what ran


def test_untracked_only_is_dirty_without_diff(repo):
    (repo / "scratch.py").write_text("x = 1\n")
    info = provenance.capture_source(repo).to_dict()
    assert info["dirty"] is True and info["changed_files"] == 0 and info["diff_sha256"] is None


def test_outside_git_records_the_package_version(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    info = provenance.capture_source(plain).to_dict()
    assert info["kind"] == "package" and "not in a git work tree" in info["reason"]
    assert info["nanscan_version"] == provenance.package_version("nanscan")


def test_environment_records_versions_and_determinism_flags():
    env = provenance.environment("cpu")
    assert env["torch"] == torch.__version__ and env["numpy"] == np.__version__ and env["backend"] == "cpu"
    assert env["deterministic"]["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert env["cuda_available"] == torch.cuda.is_available() and env["devices"]


class Optim(enum.Enum):
    ADAM = "adam"


@dataclasses.dataclass
class Config:
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    data: Path = Path("/data/shards")
    optim: Optim = Optim.ADAM
    dtype: torch.dtype = torch.bfloat16
    steps: np.int64 = np.int64(100)


def test_config_normalisation_and_stable_hash():
    config = normalize_config(Config())
    assert config == {"lr": 1e-3, "betas": [0.9, 0.95], "data": "/data/shards", "optim": "adam",
                      "dtype": "bfloat16", "steps": 100}
    assert normalize_config(argparse.Namespace(a=1, b="x")) == {"a": 1, "b": "x"}
    assert config_sha256({"a": 1, "b": [1, 2]}) == config_sha256({"b": [1, 2], "a": 1})
    assert config_sha256({"a": 1}) != config_sha256({"a": 1.5})
    assert normalize_config(None) is None and config_sha256(None) is None


@pytest.mark.parametrize("config, match", [
    ({"model": {"dropout": float("inf")}}, r"config\['model'\]\['dropout'\] is inf"),
    ({"callback": lambda: 0}, r"config\['callback'\] is a function"),
    ({(1, 2): "tuple key"}, "string keys"),
    ([1, 2], "must be a dict"),
])
def test_config_that_json_cannot_hold_is_refused(config, match):
    with pytest.raises(ConfigError, match=match):
        normalize_config(config)


def _draw() -> tuple:
    return torch.rand(3), np.random.rand(3), random.random(), np.random.randn(1)


def test_rng_capture_restore_round_trip_through_safetensors():
    np.random.randn(1)  # leaves a cached Gaussian in numpy's legacy state: it must survive the round trip
    state = capture_rng()
    expected = _draw()
    tensors, meta = rng_to_tensors(state)
    restored = rng_from_tensors(load(save(tensors)), meta)
    _draw()
    restore_rng(restored)
    again = _draw()
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1])
    assert again[2] == expected[2] and np.array_equal(again[3], expected[3])


def test_capture_rng_sources_subset():
    assert set(capture_rng(("torch",))) == {"torch_cpu", "torch_cuda"}
    assert set(capture_rng(("numpy", "python"))) == {"numpy", "python"}


def test_restore_refuses_cuda_states_without_gpus(monkeypatch):
    state = capture_rng()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="1 CUDA device"):
        restore_rng(state)


@pytest.mark.parametrize("source, damaged, match", [
    ("torch_cpu", torch.zeros(100, dtype=torch.uint8), r"torch_cpu is \(100,\)"),
    ("numpy", ("MT19937", np.zeros(3, dtype=np.uint32), 0, 0, 0.0), "numpy is not an MT19937 state"),
    ("python", (3, (1, 2), None), r"python is not a random.getstate\(\) tuple"),
])
def test_restore_refuses_a_damaged_state_and_changes_no_generator(source, damaged, match):
    state = capture_rng()
    state[source] = damaged  # as a bundle with a damaged (re-hashed) rng.safetensors would give it
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    before = capture_rng()
    with pytest.raises(ValueError, match=match):
        restore_rng(state)
    after = capture_rng()
    assert torch.equal(after["torch_cpu"], before["torch_cpu"]) and after["python"] == before["python"]
    assert np.array_equal(after["numpy"][1], before["numpy"][1]) and after["numpy"][2] == before["numpy"][2]


def test_atomic_write_replaces_whole_file_and_cleans_up_on_failure(tmp_path):
    target = tmp_path / "data.json"
    _atomic.atomic_write_json(target, {"a": 1})
    assert target.read_bytes() == b'{\n  "a": 1\n}\n'

    def fail_half_way(temp: Path) -> None:
        temp.write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _atomic.atomic_write_with(target, fail_half_way)
    assert target.read_bytes() == b'{\n  "a": 1\n}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]
    with pytest.raises(ValueError):
        _atomic.atomic_write_json(target, {"x": float("nan")})  # strict JSON: callers encode non-finite floats


def test_atomic_directory_renames_only_on_success(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with _atomic.atomic_directory(final) as temp:
            (temp / "a").write_text("1")
            raise RuntimeError("crash in the block")
    assert list(tmp_path.iterdir()) == []
    with _atomic.atomic_directory(final) as temp:
        assert _atomic.is_temp_name(temp.name) and temp.parent == tmp_path
        (temp / "a").write_text("1")
    assert (final / "a").read_text() == "1"
    with pytest.raises(FileExistsError):
        with _atomic.atomic_directory(final) as temp:
            (temp / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["a"] and list(tmp_path.iterdir()) == [final]


def test_atomic_writes_get_ordinary_permissions(tmp_path):
    file = _atomic.atomic_write_bytes(tmp_path / "f", b"x")
    with _atomic.atomic_directory(tmp_path / "d") as temp:
        (temp / "a").write_text("1")
    assert file.stat().st_mode & 0o777 == _atomic.FILE_MODE
    assert (tmp_path / "d").stat().st_mode & 0o777 == _atomic.DIR_MODE
