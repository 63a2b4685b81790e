"""Backend selection: `backend=` beats NANSCAN_BACKEND beats auto; a backend asked for by name that cannot run
raises with the original error; auto says once which backend it chose; `backend_info()` and `nanscan info` say
what is available.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import nanscan
from nanscan import _layout as L
from nanscan import backends


def loads(name: str) -> bool:
    try:
        backends.load(name)
        return True
    except backends.BackendUnavailable:
        return False


def test_explicit_backend_beats_the_environment(clean_backend_state, monkeypatch):
    monkeypatch.setenv("NANSCAN_BACKEND", "no-such-backend")
    assert nanscan.scan([torch.ones(3)], backend="reference").backend == "reference"
    instance = backends.load("reference")
    assert nanscan.scan([torch.ones(3)], backend=instance).backend == "reference"


def test_the_environment_beats_auto(clean_backend_state, monkeypatch):
    monkeypatch.setenv("NANSCAN_BACKEND", "reference")
    assert nanscan.scan([torch.ones(3)]).backend == "reference"  # auto would never pick it on a CPU
    monkeypatch.setenv("NANSCAN_BACKEND", "auto")
    assert nanscan.scan([torch.ones(3)]).backend == backends.select(torch.device("cpu")).name


def test_auto_prefers_cpu_then_numba_then_reference(clean_backend_state):
    chosen = nanscan.scan([torch.ones(3)]).backend
    assert chosen == next(name for name in ("cpu", "numba", "reference") if loads(name))


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_an_unknown_backend_raises_listing_the_choices(clean_backend_state, monkeypatch, where):
    kwargs = {"backend": "gpu"} if where == "argument" else {}
    if where == "environment":
        monkeypatch.setenv("NANSCAN_BACKEND", "gpu")
    with pytest.raises(nanscan.BackendUnavailable, match="unknown nanscan backend 'gpu'.*cpu, numba, cuda, reference"):
        nanscan.scan([torch.ones(3)], **kwargs)


def test_an_unavailable_backend_raises_with_the_original_error(clean_backend_state, monkeypatch):
    missing = ModuleNotFoundError("No module named 'numba'")

    def fail():
        raise missing

    monkeypatch.setitem(backends._LOADERS, "numba", fail)
    with pytest.raises(nanscan.BackendUnavailable, match="'numba' is unavailable: ModuleNotFoundError") as info:
        nanscan.scan([torch.ones(3)], backend="numba")
    assert info.value.__cause__ is missing
    with pytest.raises(nanscan.BackendUnavailable) as again:  # remembered, and raised the same way each time
        nanscan.scan([torch.ones(3)], backend="numba")
    assert again.value.__cause__ is missing


def test_importing_the_numba_backend_without_numba_fails_loudly(clean_backend_state, monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # what `import numba` sees where it is not installed
    monkeypatch.delitem(sys.modules, "nanscan._numba_backend", raising=False)
    with pytest.raises(nanscan.BackendUnavailable, match="numba") as info:
        backends.load("numba")
    assert isinstance(info.value.__cause__, ImportError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_raises_and_says_why(clean_backend_state):
    with pytest.raises(nanscan.BackendUnavailable, match="'cuda' is unavailable") as info:
        nanscan.scan([torch.ones(3)], backend="cuda")
    assert info.value.__cause__ is not None


def test_a_backend_for_another_device_is_refused(clean_backend_state):
    if not loads("numba"):
        pytest.skip("needs the numba backend")
    with pytest.raises(nanscan.BackendUnavailable, match="'numba' cannot scan tensors on cuda"):
        backends.select(torch.device("cuda"), "numba")


def test_numba_backend_checks_its_arguments():
    if not loads("numba"):
        pytest.skip("needs the numba backend")
    from nanscan._numba_backend import NumbaBackend

    with pytest.raises(ValueError, match="chunk_elems must be a number of elements from 1"):
        NumbaBackend(chunk_elems=0)
    backend = NumbaBackend()
    assert backend.supports(torch.device("cpu")) and not backend.supports(torch.device("cuda"))


def test_auto_announces_its_choice_once(clean_backend_state, caplog):
    caplog.set_level(logging.INFO, logger="nanscan")
    nanscan.scan([torch.ones(3)])
    nanscan.scan([torch.ones(3)])
    chosen = backends.select(torch.device("cpu")).name
    announcements = [r for r in caplog.records if "scanning cpu tensors with" in r.getMessage()]
    assert len(announcements) == 1
    assert f"{chosen!r} backend" in announcements[0].getMessage()


def test_auto_says_why_a_better_backend_is_missing(clean_backend_state, monkeypatch, caplog):
    def no_compiler():
        raise ImportError("nanscan._C was not built")

    monkeypatch.setitem(backends._LOADERS, "cpu", no_compiler)
    caplog.set_level(logging.INFO, logger="nanscan")
    report = nanscan.scan([torch.ones(3)])
    assert report.backend in ("numba", "reference")
    (record,) = [r for r in caplog.records if "scanning cpu tensors with" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "unavailable: cpu (ImportError: nanscan._C was not built)" in record.getMessage()


def test_an_explicit_choice_is_not_announced(clean_backend_state, caplog):
    caplog.set_level(logging.INFO, logger="nanscan")
    nanscan.scan([torch.ones(3)], backend="reference")
    assert not [r for r in caplog.records if "scanning cpu tensors with" in r.getMessage()]


def test_backend_info_reports_availability(clean_backend_state):
    info = nanscan.backend_info()
    assert set(info["backends"]) == {"cpu", "numba", "cuda", "reference"}
    assert info["backends"]["reference"] == {"available": True}
    for name, entry in info["backends"].items():
        assert entry["available"] == loads(name), name
        assert entry["available"] or entry["error"], f"{name} is unavailable but says nothing about why"
    assert info["active"]["cpu"] == backends.select(torch.device("cpu")).name
    assert ("cuda" in info["active"]) == torch.cuda.is_available()


def run_info(env_backend: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NANSCAN_BACKEND"}
    if env_backend is not None:
        env["NANSCAN_BACKEND"] = env_backend
    done = subprocess.run([sys.executable, "-m", "nanscan", "info", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_nanscan_info_json_in_a_fresh_process():
    info = run_info("reference")
    assert info["env"] == {"NANSCAN_BACKEND": "reference"}
    assert info["active"]["cpu"] == "reference"
    in_process = {name: entry["available"] for name, entry in nanscan.backend_info()["backends"].items()}
    assert {name: entry["available"] for name, entry in info["backends"].items()} == in_process
    if in_process["cpu"]:
        assert info["build"]["record_width"] == L.RECORD_WIDTH
    else:
        assert "error" in info["build"]
