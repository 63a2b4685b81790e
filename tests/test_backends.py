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
from nanscan.engine import _layout as L
from nanscan.engine import backends


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
    with pytest.raises(nanscan.BackendUnavailable, match="unknown nanscan backend 'gpu'.*cpu, numba, cuda, numba-cuda, reference"):
        nanscan.scan([torch.ones(3)], **kwargs)


def test_a_backend_named_by_the_environment_says_so_and_how_to_undo_it(clean_backend_state, monkeypatch):
    """Nothing in the caller's code names a backend set in NANSCAN_BACKEND (perhaps long ago, in a shell profile):
    the error must point there."""
    monkeypatch.setenv("NANSCAN_BACKEND", "gpu")
    with pytest.raises(nanscan.BackendUnavailable, match="'gpu' in NANSCAN_BACKEND; set it to auto or one of "
                                                         "cpu, numba, cuda, numba-cuda, reference, or unset it"):
        nanscan.scan([torch.ones(3)])
    missing = ModuleNotFoundError("No module named 'numba'")

    def fail():
        raise missing

    monkeypatch.setitem(backends._LOADERS, "numba", fail)
    monkeypatch.setenv("NANSCAN_BACKEND", "numba")
    with pytest.raises(nanscan.BackendUnavailable) as info:
        nanscan.scan([torch.ones(3)])
    assert str(info.value).startswith("NANSCAN_BACKEND=numba: nanscan backend 'numba' is unavailable: "
                                      "ModuleNotFoundError")
    assert "unset NANSCAN_BACKEND (or set it to auto) to let nanscan choose" in str(info.value)
    assert info.value.__cause__ is missing


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
    monkeypatch.delitem(sys.modules, "nanscan.engine.backends.numba_cpu", raising=False)
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
    from nanscan.engine.backends.numba_cpu import NumbaBackend

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


def test_a_missing_native_extension_says_what_to_do(clean_backend_state, monkeypatch):
    """What `nanscan info` shows for the cpu backend after an install without a C++ compiler."""
    monkeypatch.delattr(nanscan, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "nanscan._C", None)  # what the import sees where the extension was not built
    with pytest.raises(nanscan.BackendUnavailable) as info:
        backends.load("cpu")
    assert "the native extension nanscan._C is not built" in str(info.value)
    assert "reinstall nanscan where a C++ compiler is available" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError) and isinstance(info.value.__cause__.__cause__, ImportError)
    assert "reinstall nanscan" in nanscan.backend_info()["backends"]["cpu"]["error"]


def test_an_explicit_choice_is_not_announced(clean_backend_state, caplog):
    caplog.set_level(logging.INFO, logger="nanscan")
    nanscan.scan([torch.ones(3)], backend="reference")
    assert not [r for r in caplog.records if "scanning cpu tensors with" in r.getMessage()]


def test_backend_info_reports_availability(clean_backend_state):
    info = nanscan.backend_info()
    assert set(info["backends"]) == {"cpu", "numba", "cuda", "numba-cuda", "reference"}
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


def invoke_info(monkeypatch, env_backend: str | None, *args: str):
    from click.testing import CliRunner

    from nanscan.cli.main import main

    if env_backend is not None:
        monkeypatch.setenv("NANSCAN_BACKEND", env_backend)
    return CliRunner().invoke(main, ["info", *args], env={"COLUMNS": "40"})


@pytest.mark.parametrize("as_json", [False, True])
def test_nanscan_info_fails_when_the_environment_names_a_backend_that_cannot_run(clean_backend_state, monkeypatch,
                                                                                 as_json):
    """Exit 2 for a name that is no backend, 1 for one that cannot run here; the reason is printed whole, even on a
    narrow terminal, and --json stays valid JSON on stdout."""
    extra = ["--json"] if as_json else []
    bogus = invoke_info(monkeypatch, "bogus", *extra)
    assert bogus.exit_code == 2, bogus.output
    if as_json:
        assert json.loads(bogus.stdout)["active"]["cpu"].startswith("error: unknown nanscan backend 'bogus'")
    else:
        assert ("active on cpu: none: unknown nanscan backend 'bogus' in NANSCAN_BACKEND; set it to auto or one of "
                "cpu, numba, cuda, numba-cuda, reference, or unset it") in bogus.stdout.splitlines()

    backends._loaded.clear()  # the first call loaded every backend; load numba again, failing this time
    monkeypatch.setitem(backends._LOADERS, "numba", lambda: (_ for _ in ()).throw(ImportError("no numba here")))
    missing = invoke_info(monkeypatch, "numba", *extra)
    assert missing.exit_code == 1, missing.output
    if not as_json:
        (line,) = [line for line in missing.stdout.splitlines() if line.startswith("active on cpu")]
        assert line.startswith("active on cpu: none: NANSCAN_BACKEND=numba: nanscan backend 'numba' is unavailable")
        assert "no numba here" in line and line.endswith("or see `nanscan info` for what runs here")


def test_nanscan_info_says_what_chose_the_backend_and_folds_long_details(clean_backend_state, monkeypatch):
    def no_extension():
        raise ImportError("nanscan._C was not built [no compiler] so the cpu backend is missing")

    monkeypatch.setitem(backends._LOADERS, "cpu", no_extension)
    auto = invoke_info(monkeypatch, None)
    assert auto.exit_code == 0, auto.output
    chosen = backends.select(torch.device("cpu")).name
    assert f"active on cpu: {chosen} (auto: the best available)" in " ".join(auto.stdout.split())
    # the whole detail, brackets included, folded into the narrow column rather than cut off
    cells = "".join(line.split("│")[3].strip() for line in auto.stdout.splitlines() if line.count("│") == 4)
    assert "nanscan._Cwasnotbuilt[nocompiler]sothecpubackendismissing" in cells.replace(" ", "")

    named = invoke_info(monkeypatch, "reference")
    assert named.exit_code == 0, named.output
    assert "active on cpu: reference (set by NANSCAN_BACKEND=reference)" in " ".join(named.stdout.split())


def test_nanscan_info_with_cuda_requested(clean_backend_state, monkeypatch):
    """Without a GPU (or a CUDA build) NANSCAN_BACKEND=cuda cannot run: exit 1. With one it runs, and only checks on
    CPU tensors alone fall outside it, which the output says."""
    result = invoke_info(monkeypatch, "cuda")
    cuda_runs = loads("cuda")
    assert result.exit_code == (0 if cuda_runs else 1), result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("active on cpu")]
    assert line.startswith("active on cpu: none: NANSCAN_BACKEND=cuda: nanscan backend 'cuda' ")
    assert line.endswith("unset NANSCAN_BACKEND (or set it to auto) to let nanscan choose, or see `nanscan info` for "
                         "what runs here")


def test_a_command_that_meets_an_unusable_backend_ends_with_a_message(clean_backend_state, monkeypatch, tmp_path):
    """The same NANSCAN_BACKEND problems met by any subcommand that scans: one line and the exit status, no
    traceback."""
    from click.testing import CliRunner

    from nanscan.cli.main import main

    monkeypatch.setenv("NANSCAN_BACKEND", "bogus")
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "bogus")])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines()[-1] == ("Error: unknown nanscan backend 'bogus' in NANSCAN_BACKEND; set it to "
                                              "auto or one of cpu, numba, cuda, numba-cuda, reference, or unset it")

    monkeypatch.setitem(backends._LOADERS, "numba", lambda: (_ for _ in ()).throw(ImportError("no numba here")))
    monkeypatch.setenv("NANSCAN_BACKEND", "numba")
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "numba")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines()[-1].startswith("Error: NANSCAN_BACKEND=numba: nanscan backend 'numba' is "
                                                     "unavailable: ImportError: no numba here")


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


def test_nanscan_info_says_the_cuda_part_is_compiled_and_whether_it_can_run_here(clean_backend_state, monkeypatch):
    """build_info()'s "cuda" is whether the CUDA part was compiled: on a CPU-only torch it cannot run, and the build
    line says so (the --json key stays "cuda")."""
    result = invoke_info(monkeypatch, None)
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("build:")]
    as_json = json.loads(invoke_info(monkeypatch, None, "--json").stdout)["build"]
    if "error" in as_json:
        assert line == f"build: {as_json}"
        return
    compiled = as_json["cuda"]
    assert isinstance(compiled, bool)
    note = backends.cuda_build_note(compiled, torch.version.cuda, torch.cuda.is_available())
    assert line.startswith(f"build: cuda_compiled: {compiled} ({note}), openmp: ")
    assert "'cuda'" not in line and " cuda: " not in line
    assert backends.cuda_build_note(True, None, False) == "torch has no CUDA: not usable here"
    assert backends.cuda_build_note(True, "12.4", False) == "torch (CUDA 12.4) sees no GPU: not usable here"
    assert backends.cuda_build_note(True, "12.4", True) == "usable here"
    assert backends.cuda_build_note(False, "12.4", True) == "the cuda backend needs a build with nvcc"
