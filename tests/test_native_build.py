"""The native extension: its constants agree with Python's, each path of the CPU kernel agrees with the reference
(csrc/cpu/scan_cpu.cpp, NOTE: [blocks] and [chunk window]), a scan reads its inputs in place, and nanscan installs
and falls back to numba where no C++ compiler works, in a normal and an editable install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_records_match
from nanscan.engine import _layout as L
from nanscan.engine.backends import CpuBackend
from nanscan.bench_scan import peak_extra_bytes
from nanscan.engine.inputs import prepare_all
from nanscan.scan import scan

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CODES = {torch.float16: L.FLOAT16, torch.bfloat16: L.BFLOAT16, torch.float32: L.FLOAT32, torch.float64: L.FLOAT64}


# -- the extension and nanscan/engine/_layout.py describe one layout ---------------------------------------------------

def test_build_info_matches_layout(native):
    info = native.build_info()
    assert info["record_width"] == L.RECORD_WIDTH
    assert info["hist_bins"] == L.HIST_BINS
    assert info["min_bin_exponent"] == L.MIN_BIN_EXPONENT
    assert info["max_bin_exponent"] == L.MAX_BIN_EXPONENT
    assert info["abs_min_none"] == L.ABSMIN_NONE
    assert info["record_slots"] == {
        "nan": L.REC_NAN, "posinf": L.REC_POSINF, "neginf": L.REC_NEGINF, "zero": L.REC_ZERO,
        "subnormal": L.REC_SUBNORMAL, "absmax_bits": L.REC_ABSMAX_BITS, "absmin_bits": L.REC_ABSMIN_BITS,
        "sumsq": L.REC_SUMSQ, "hist": L.REC_HIST, "fingerprint": L.REC_FINGERPRINT,
    }
    assert info["dtype_codes"] == L.DTYPE_CODES
    assert info["cpu_simd"] in ("avx512", "avx2", "baseline", "none")
    # float8's vector paths need the instruction sets they are named for (NOTE: [byte formats]).
    assert info["cpu_float8"] in {"avx512": ("avx512", "avx2", "patterns"), "avx2": ("avx2", "patterns")}.get(
        info["cpu_simd"], ("patterns",))


# One pattern per dtype code that every other code reads differently: 1.0, the largest finite value, +inf, a quiet
# NaN, the smallest subnormal, and -0. Bins are floor(log2|x|) + 128.
KNOWN_PATTERNS = {
    L.FLOAT16: [(0x3C00, L.NORMAL, 128), (0x7BFF, L.NORMAL, 143), (0x7C00, L.POSINF, -1), (0x7E00, L.NAN, -1),
                (0x0001, L.SUBNORMAL, 104), (0x8000, L.ZERO, -1)],
    L.BFLOAT16: [(0x3F80, L.NORMAL, 128), (0x7F7F, L.NORMAL, 255), (0x7F80, L.POSINF, -1), (0x7FC0, L.NAN, -1),
                 (0x0001, L.SUBNORMAL, 0), (0x8000, L.ZERO, -1)],
    L.FLOAT32: [(0x3F800000, L.NORMAL, 128), (0x7F7FFFFF, L.NORMAL, 255), (0x7F800000, L.POSINF, -1),
                (0x7FC00000, L.NAN, -1), (0x00000001, L.SUBNORMAL, 0), (0x80000000, L.ZERO, -1)],
    L.FLOAT64: [(0x3FF0000000000000, L.NORMAL, 128), (0x7FEFFFFFFFFFFFFF, L.NORMAL, 255),
                (0x7FF0000000000000, L.POSINF, -1), (0x7FF8000000000000, L.NAN, -1), (0x1, L.SUBNORMAL, 0),
                (0x8000000000000000, L.ZERO, -1)],
}


@pytest.mark.parametrize("code", sorted(KNOWN_PATTERNS), ids=lambda c: L.DTYPE_NAMES[c])
def test_dtype_codes_classify_as_their_format(native, code):
    bits = np.array([p for p, _, _ in KNOWN_PATTERNS[code]], dtype=np.uint64)
    classes, bins = native.classify_bits(bits, code)
    assert classes.tolist() == [c for _, c, _ in KNOWN_PATTERNS[code]]
    assert bins.tolist() == [b for _, _, b in KNOWN_PATTERNS[code]]
    # The same patterns read as any other format must not all give the same answers.
    for other in KNOWN_PATTERNS:
        if other != code:
            other_classes, other_bins = native.classify_bits(bits, other)
            assert (other_classes.tolist(), other_bins.tolist()) != (classes.tolist(), bins.tolist())


# -- the read probe ------------------------------------------------------------------------------------------------

def _task_arrays(tensors):
    ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    numels = np.array([t.numel() for t in tensors], dtype=np.int64)
    codes = np.array([CODES[t.dtype] for t in tensors], dtype=np.int32)
    return ptrs, numels, codes


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 16])
def test_read_probe_reads_every_byte(native, chunk):
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen).to(d) for n, d in
               [(0, torch.float32), (1, torch.float32), (1001, torch.float16), (70_001, torch.float32),
                (333, torch.float64), (4097, torch.bfloat16)]]
    expected = 0
    for t in tensors:
        if t.numel():
            expected ^= int(np.bitwise_xor.reduce(t.view(torch.uint8).numpy()))
    assert native.read_bandwidth_probe(*_task_arrays(tensors), chunk) == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_returns_how_many_tensors_are_not_finite(native, dtype):
    """scan_cpu's return value is the Monitor's verdict (CpuBackend.scan_with_verdict): it must count exactly the
    tensors whose records hold a NaN or an infinity, whatever kind, wherever in the tensor."""
    gen = torch.Generator().manual_seed(3)
    finite = [torch.randn(n, generator=gen).to(dtype) for n in (1, 100, 70_001)]
    bad = []
    for value, at in ((float("nan"), 0), (float("inf"), 4096), (float("-inf"), 70_000)):
        t = torch.randn(70_001, generator=gen).to(dtype)
        t[at] = value
        bad.append(t)
    payload = torch.zeros(5, dtype=dtype)
    width = payload.element_size() * 8
    bits = payload.view({16: torch.int16, 32: torch.int32, 64: torch.int64}[width])
    bits[2] = -1  # a NaN with every payload bit and the sign set
    tensors = [finite[0], bad[0], finite[1], bad[1], payload, finite[2], bad[2], torch.zeros(0, dtype=dtype)]
    records = np.empty((len(tensors), L.RECORD_WIDTH), dtype=np.int64)
    count = native.scan_cpu(*_task_arrays(tensors), records, 4096)
    assert count == 4
    assert count == int(np.count_nonzero(records[:, L.REC_NAN : L.REC_NEGINF + 1].any(axis=1)))
    assert native.scan_cpu(*_task_arrays(finite), L.empty_records(3), 4096) == 0

    backend = CpuBackend()
    for group, expected in ((tensors, True), (finite, False)):
        inputs, _ = prepare_all({str(i): t for i, t in enumerate(group)})
        got, nonfinite = backend.scan_with_verdict(inputs)
        assert nonfinite is expected
        assert np.array_equal(got, backend.scan_records(inputs))


def test_scan_arguments_are_checked(native):
    t = torch.ones(4)
    ptrs, numels, codes = _task_arrays([t])
    records = L.empty_records(1)
    with pytest.raises(ValueError, match="same length"):
        native.scan_cpu(ptrs, np.array([4, 4]), codes, records, 16)
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        native.scan_cpu(ptrs, numels, np.array([9], dtype=np.int32), records, 16)
    with pytest.raises(ValueError, match="negative"):
        native.scan_cpu(ptrs, np.array([-1]), codes, records, 16)
    with pytest.raises(ValueError, match="null"):
        native.scan_cpu(np.array([0]), numels, codes, records, 16)
    with pytest.raises(ValueError, match="records must have shape"):
        native.scan_cpu(ptrs, numels, codes, L.empty_records(2), 16)
    with pytest.raises(ValueError, match="same length"):
        native.read_bandwidth_probe(ptrs, np.array([4, 4]), codes, 16)


# -- each path of the CPU kernel agrees with the reference ---------------------------------------------------------

def _finite_range(dtype):
    info = torch.finfo(dtype)
    return int(np.floor(np.log2(info.tiny))), int(np.floor(np.log2(info.max)))


def kernel_path_tensors(dtype, *, blocks: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of whole 4 KiB blocks, each steering the kernel down one path (NOTE: [blocks] in scan_cpu.cpp)."""
    gen = torch.Generator().manual_seed(seed)
    per_block = 4096 // torch.tensor([], dtype=dtype).element_size()
    n = blocks * per_block
    lo, hi = _finite_range(dtype)
    mid = (lo + hi) // 2

    def randn(count, scale):
        return torch.randn(count, generator=gen, dtype=torch.float64) * scale

    def log_uniform(count, low, high):  # |x| spread evenly over binades low..high, random signs
        e = low + (high - low) * torch.rand(count, generator=gen, dtype=torch.float64)
        return torch.exp2(e) * torch.sign(torch.randn(count, generator=gen, dtype=torch.float64))

    gauss = randn(n, 1.0)
    # Every third block of `shifting` lives some binades higher: the chunk's window misses it, and after two such
    # blocks in a row (the last two) moves.
    shift = torch.ones(blocks, 1, dtype=torch.float64)
    shift[::3] = shift[-2:] = 2.0 ** (8 if dtype == torch.float16 else 24)
    shifting = randn(n, 1.0).reshape(blocks, per_block) * shift
    zero_blocks = randn(n, 1.0).reshape(blocks, per_block)
    zero_blocks[1::2] = 0.0  # blocks with nothing but zeros inside the window
    zero_blocks[2::4, ::3] = 0.0  # and blocks with some zeros
    smallest_subnormal = float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps)
    subnormal = randn(n, 2.0 ** (lo + 8))
    subnormal[::97] = smallest_subnormal * 3
    subnormal[5::101] = -(2.0 ** lo) / 2  # the largest binade of subnormals
    only_subnormal = torch.randint(0, 4, (n,), generator=gen, dtype=torch.float64) * smallest_subnormal
    specials = randn(n, 1.0)
    specials[17::1500] = float("nan")
    specials[29::2900] = float("inf")
    specials[31::4100] = -float("inf")
    specials[3::2000] = 0.0
    extremes = log_uniform(n, hi - 12, hi)  # the top fields: the windows run past the last finite one
    extremes[::50] = torch.finfo(dtype).max
    tensors = {
        "gauss": gauss,
        "shifting": shifting.reshape(-1),
        "two windows": log_uniform(n, mid - 8, mid + 14),  # 17..32 fields per block
        "wide": log_uniform(n, lo, hi),  # more than 32 fields per block
        "zero blocks": zero_blocks.reshape(-1),
        "subnormal": subnormal,
        "only subnormal": only_subnormal,
        "specials": specials,
        "extremes": extremes,
        "bottom": log_uniform(n, lo, lo + 10),  # the lowest normal fields
        "tail": gauss[: 3 * per_block + 37],  # a short last block in every chunk
        "tiny": gauss[:5],
    }
    return {name: x.to(dtype) for name, x in tensors.items()}


def scan_records(tensors, **backend_kwargs) -> np.ndarray:
    return scan(tensors, backend=CpuBackend(**backend_kwargs)).records


_reference_records: dict[tuple, np.ndarray] = {}


def reference_records(tensors: dict[str, torch.Tensor], key: tuple) -> np.ndarray:
    """The reference scan of `tensors`, computed once per key (it is slow for 16-bit formats)."""
    if key not in _reference_records:
        _reference_records[key] = scan(tensors, backend="reference").records
    return _reference_records[key]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [1 << 16, 1 << 22, 3000, 7])
def test_kernel_paths_match_the_reference(native, dtype, chunk):
    # 12 blocks of 4 KiB per tensor: one chunk of 65536 elements holds them all, so the chunk's window is placed,
    # used, missed and moved; chunks of 3000 and 7 elements cut blocks short.
    blocks = 4 if chunk == 7 else 12
    tensors = kernel_path_tensors(dtype, blocks=blocks)
    report = scan(tensors, backend=CpuBackend(chunk_elems=chunk))
    expected = reference_records(tensors, (dtype, blocks))
    assert_records_match(report.records, expected, report.names, label=f"cpu, chunks of {chunk}")
    # The data reaches the paths it is meant for.
    assert report["specials"].nan > 0 and report["specials"].posinf > 0 and report["specials"].neginf > 0
    assert report["only subnormal"].subnormal > 0 and report["subnormal"].subnormal > 0
    assert report["zero blocks"].zero > len(tensors["zero blocks"]) // 3


def test_window_counters_flush_before_they_overflow(native):
    """A chunk of over 257 in-window blocks of float16 (NOTE: [chunk window], 16-bit counters)."""
    gen = torch.Generator().manual_seed(2)
    x = {"ones": torch.ones(600_000, dtype=torch.float16),  # every element in one field: the worst case
         "gauss": (torch.randn(600_000, generator=gen) * 0.1).to(torch.float16)}
    report = scan(x, backend=CpuBackend(chunk_elems=1 << 22))
    assert_records_match(report.records, scan(x, backend="reference").records, report.names, label="cpu")
    assert report["ones"].exp_hist[128] == 600_000
    # One block of values opens the window, then over 512 blocks of zeros (field 0, counted on residue 0) follow.
    values = x["gauss"][:2048]
    zeros_after = torch.cat([values, torch.zeros(1_200_000, dtype=torch.float16)])
    got = scan({"zeros after": zeros_after}, backend=CpuBackend(chunk_elems=1 << 22))["zeros after"]
    want = scan({"values": values}, backend="reference")["values"]
    assert got.zero == want.zero + 1_200_000
    assert np.array_equal(got.exp_hist, want.exp_hist)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_records_are_bit_identical_for_any_thread_count(native, dtype):
    tensors = kernel_path_tensors(dtype, blocks=16, seed=5)
    runs = [scan_records(tensors, chunk_elems=4096, num_threads=n) for n in (1, 2, 3, 8)]
    for n, records in zip((2, 3, 8), runs[1:]):
        assert np.array_equal(records, runs[0]), f"{n} threads changed the records (sums of squares included)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flush_to_zero_mode_of_the_caller_changes_nothing(native, dtype):
    """NOTE: [float mode]: subnormals are squared and binned the same with torch.set_flush_denormal(True)."""
    tensors = {k: v for k, v in kernel_path_tensors(dtype, blocks=8, seed=7).items()
               if k in ("subnormal", "only subnormal", "bottom")}
    plain = [scan_records(tensors, num_threads=n) for n in (1, 2)]
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals; the test needs one that can"
    try:
        flushed = [scan_records(tensors, num_threads=n) for n in (1, 2)]
    finally:
        torch.set_flush_denormal(False)
    for records in plain[1:] + flushed:
        assert np.array_equal(records, plain[0])


def test_scan_allocates_only_its_result(native):
    """64 MiB of inputs: a scan must not copy them (only per-chunk partial records, ~0.5 MiB here)."""
    tensors = {"big": torch.randn(16 << 20), "small": torch.randn(1000)}
    scan(tensors, backend="cpu")  # first call: thread pool, lazy imports
    extra = peak_extra_bytes(lambda: scan(tensors, backend="cpu"))
    if extra is None:
        pytest.skip("peak memory is not measurable here (needs Linux /proc/self/clear_refs)")
    assert extra < 4 << 20, f"one scan of 64 MiB raised peak memory by {extra / 2**20:.1f} MiB"


def test_scan_benchmark_runs_end_to_end(native, tmp_path, capsys):
    from nanscan import bench_scan

    out = tmp_path / "results" / "bench.json"
    assert bench_scan.main(["--scale", "0.002", "--reps", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["validation"]["problems"] == []
    assert data["machine"]["cpu"]["model_name"]  # which kind of CPU: results differ between kinds
    assert {r["name"] for r in data["results"]} >= {"nanscan cpu", "read probe", "_foreach_norm", "isfinite loop"}
    # every float8 format beside the 16-bit ones, each with its own set and ratio lines
    for section, dtype in (("float8", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2")):
        assert data[section]["dtype"] == dtype and {r["name"] for r in data[section]["results"]} >= {
            "nanscan cpu", "read probe", "float isfinite loop"}
    assert {r["name"] for r in data["bfloat16"]["results"]} >= {"nanscan cpu", "read probe", "isfinite loop"}
    keys = ["cpu/read_limit", "cpu/isfinite_loop", "cpu/foreach_norm", "bfloat16 cpu/read_limit",
            "float16 cpu/read_limit", "float8_e4m3fn cpu/read_limit", "float8_e4m3fn cpu/float_isfinite_loop",
            "float8_e5m2 cpu/read_limit", "float8_e5m2 cpu/float_isfinite_loop"]
    if "numba" in data["validation"]["backends"]:  # the fallback's lines beside the kernel's, for every dtype
        keys += ["numba/read_limit", "bfloat16 numba/read_limit", "float16 numba/read_limit",
                 "float8_e4m3fn numba/read_limit", "float8_e5m2 numba/read_limit", "numba/cpu", "bfloat16 numba/cpu",
                 "float16 numba/cpu", "float8_e4m3fn numba/cpu", "float8_e5m2 numba/cpu"]
    for key in keys:
        assert data["ratios"][key] > 0
        assert f"{key} = " in printed


# -- installing without a working C++ compiler ---------------------------------------------------------------------

def copy_source(dest: Path) -> Path:
    """The files a build needs, without built extensions: builds there cannot touch the working tree."""
    ignore = shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "*.nbi", "*.nbc")
    dest.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "csrc", dest / "csrc", ignore=ignore)
    shutil.copytree(ROOT / "nanscan", dest / "nanscan", ignore=ignore)
    return dest


def no_compiler_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANSCAN_")}
    false = shutil.which("false") or "false"
    env.update(CC=false, CXX=false, LDSHARED=f"{false} -shared", NANSCAN_CUDA="0", **extra)
    return env


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.slow
def test_install_without_a_compiler_falls_back_to_numba(tmp_path):
    src = copy_source(tmp_path / "src")
    target = tmp_path / "site"
    # --target installs beside the environment, never replacing the nanscan installed in it.
    result = run([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index",
                  "--target", str(target), str(src)], env=no_compiler_env())
    assert result.returncode == 0, f"install failed without a compiler:\n{result.stdout}\n{result.stderr}"
    assert "native extension not built" in result.stdout + result.stderr
    # nanscan/_C.pyi, the extension's typed stub, is package data: it is installed whether or not the build works.
    assert (target / "nanscan" / "_C.pyi").is_file()
    built = [p for p in (target / "nanscan").glob("_C*") if p.suffix != ".pyi"]
    assert not built, "a failed build left an extension file behind"

    # The environment running the tests may hold an editable install of this tree, whose import hook would
    # supply nanscan._C to any nanscan package: the probe removes that hook first.
    probe = ("import json, sys; "
             "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]; "
             "import nanscan; info = nanscan.backend_info(); "
             "print(json.dumps({'file': nanscan.__file__, 'info': info}, default=str))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANSCAN_BACKEND")}
    env["PYTHONPATH"] = str(target)
    result = run([sys.executable, "-c", probe], env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).is_relative_to(target), f"imported {out['file']}, not the installed copy"
    cpu = out["info"]["backends"]["cpu"]
    assert cpu["available"] is False and "the native extension nanscan._C is not built" in cpu["error"]
    assert "reinstall nanscan where a C++ compiler is available" in cpu["error"]
    try:
        import numba  # noqa: F401
    except ImportError:
        assert out["info"]["active"]["cpu"] == "reference"
    else:
        assert out["info"]["active"]["cpu"] == "numba"


@pytest.mark.slow
def test_editable_build_without_a_compiler_succeeds(tmp_path):
    """The PEP 660 hook that `pip install -e` runs: it must not fail copying the extension it could not build,
    nor leave an older build of it importable."""
    src = copy_source(tmp_path / "src")
    # An extension from an earlier build, which the editable install would import instead of falling back.
    stale = src / "nanscan" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    stale.write_bytes(b"not a shared library")
    out = tmp_path / "wheels"
    out.mkdir()
    hook = f"from setuptools import build_meta; print(build_meta.build_editable({str(out)!r}))"
    result = run([sys.executable, "-c", hook], env=no_compiler_env(), cwd=src)
    assert result.returncode == 0, f"editable build failed without a compiler:\n{result.stdout}\n{result.stderr}"
    wheel = out / result.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "_C." in n], names
    assert not stale.exists(), "the stale extension of an earlier build was left in the source tree"


@pytest.mark.slow
def test_required_native_build_fails_loudly_without_a_compiler(tmp_path):
    src = copy_source(tmp_path / "src")
    out = tmp_path / "wheels"
    out.mkdir()
    hook = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    result = run([sys.executable, "-c", hook], env=no_compiler_env(NANSCAN_REQUIRE_NATIVE="1"), cwd=src)
    assert result.returncode != 0
    assert not list(out.glob("*.whl"))


PORTABLE_CHECK = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path.insert(0, {tests!r})
import numpy as np, torch
import nanscan
from nanscan import _C
from nanscan.engine.backends import CpuBackend
from test_native_build import kernel_path_tensors, DTYPES
from conftest import assert_records_match
for dtype in DTYPES:
    for chunk, blocks in ((1 << 16, 12), (3000, 12), (7, 4)):
        tensors = kernel_path_tensors(dtype, blocks=blocks)
        report = nanscan.scan(tensors, backend=CpuBackend(chunk_elems=chunk))
        reference = nanscan.scan(tensors, backend="reference")
        assert_records_match(report.records, reference.records, report.names, label=f"{{dtype}}, chunks of {{chunk}}")
from conftest import FLOAT8_DTYPES
from test_float8_scan import float8_path_tensors
for dtype in FLOAT8_DTYPES:  # per bit pattern, or by the AVX2 path (NOTE: [byte formats], [byte vectors on AVX2])
    tensors = float8_path_tensors(dtype)
    reference = nanscan.scan(tensors, backend="reference")
    for chunk in (1 << 16, 7):
        report = nanscan.scan(tensors, backend=CpuBackend(chunk_elems=chunk))
        assert_records_match(report.records, reference.records, report.names, label=f"{{dtype}}, chunks of {{chunk}}")
info = _C.build_info()
print(json.dumps({{"file": _C.__file__, "simd": info["cpu_simd"], "float8": info["cpu_float8"]}}))
"""


def cpu_flags() -> set[str]:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["0", "x86-64-v3"])
def test_portable_kernel_matches_the_reference(tmp_path, arch):
    """The kernel built without -march=native takes the vector-extension paths instead of AVX-512 ones (NOTE:
    [vector types] in csrc/cpu/simd.h), and built for x86-64-v3 (AVX2) it reads float8 by the AVX2 path (NOTE:
    [byte vectors on AVX2] in csrc/cpu/scan_cpu.cpp), which a machine with AVX-512's byte instructions would not
    otherwise run: built into a separate directory, each must agree with the reference just the same."""
    if not shutil.which(os.environ.get("CXX", "g++")):
        pytest.skip("no C++ compiler here")
    if os.environ.get("NANSCAN_BACKEND"):
        # The builds are checked with CpuBackend whatever the default backend: the second run of the suite (make
        # test, NANSCAN_BACKEND=numba) would build and check the same kernels again, a minute or more each.
        pytest.skip("the kernel's builds are checked in the run without NANSCAN_BACKEND")
    if arch != "0":
        if not {"avx2", "popcnt", "bmi1", "bmi2", "fma", "f16c"} <= cpu_flags():
            pytest.skip(f"this CPU cannot run code built for {arch}")
        from nanscan.engine._native import native_module
        try:
            native_float8 = native_module().build_info()["cpu_float8"]
        except ImportError:
            native_float8 = None
        if native_float8 == "avx2":
            pytest.skip("the native build already reads float8 by the AVX2 path, which the other tests check")
    src = copy_source(tmp_path / "src")
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANSCAN_")}
    env.update(NANSCAN_NATIVE_ARCH=arch, NANSCAN_CUDA="0", NANSCAN_REQUIRE_NATIVE="1")
    result = run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                  "--target", str(target), str(src)], env=env)
    assert result.returncode == 0, f"portable build failed:\n{result.stdout}\n{result.stderr}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANSCAN_BACKEND")}
    env["PYTHONPATH"] = str(target)
    check = PORTABLE_CHECK.format(tests=str(Path(__file__).parent))
    result = run([sys.executable, "-c", check], env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).is_relative_to(target)
    if arch == "0":
        assert out["simd"] != "avx512" and out["float8"] == "patterns"
    else:
        assert (out["simd"], out["float8"]) == ("avx2", "avx2")



def test_plan_check_refuses_inconsistent_tables_and_passes_errors_out_of_the_scan(native):
    """nanscan._C.PlanCheck: its lists must agree in length; an error raised by the check inside the scan's
    parallel region (NOTE: [wake overlap]) reaches the caller as it was, with every thread released."""
    weight = torch.ones(3, 5000)  # several chunks of 4096 elements: the other threads have work to wait for
    args = dict(child_dicts=[{}], children=[], param_dicts=[{"w": weight}], raw_params=[weight], state_values=[],
                params=[weight], grad_absent=[True], state_tensors=[], stable_ptrs=np.array([weight.data_ptr()]),
                stable_dtypes=[weight.dtype], stable_nbytes=np.array([weight.nbytes]),
                data_ptr=torch.Tensor.data_ptr, is_contiguous=torch.Tensor.is_contiguous)
    with pytest.raises(ValueError, match="one per parameter"):
        native.PlanCheck(**{**args, "grad_absent": []})
    check = native.PlanCheck(**args)
    numels, codes = np.array([weight.numel()]), np.array([L.FLOAT32], dtype=np.int32)
    records = L.empty_records(1)
    assert check.check_and_scan(None, [], numels, codes, records, 4096, 2) == 0
    assert records[0, L.REC_HIST:L.REC_HIST_END].sum() == weight.numel()
    ptrs, grads = check.check(None, [])
    assert ptrs.tolist() == [weight.data_ptr()] and grads == []
    with pytest.raises(ValueError, match="numels and dtypes must have the same length"):
        check.check_and_scan(None, [], np.array([1, 2]), codes, records, 4096, 2)
    with pytest.raises(ValueError, match="one entry per input"):
        check.check_and_scan(None, [], np.array([1, 2]), np.array([L.FLOAT32] * 2, dtype=np.int32),
                             L.empty_records(2), 4096, 2)
    with pytest.raises(ValueError, match="one entry per input"):
        check.check_scan_summary(None, [], native.ScanTable(np.array([1, 2]), codes.repeat(2)), 4096, 2)

    def failing(tensor):
        raise RuntimeError("data_ptr failed")
    broken = native.PlanCheck(**{**args, "data_ptr": failing})
    for _ in range(3):
        with pytest.raises(RuntimeError, match="data_ptr failed"):
            broken.check_and_scan(None, [], numels, codes, records, 4096, 2)
    weight.data = torch.full((3, 5000), float("nan"))  # moved: the check fails, and nothing is scanned
    assert check.check_and_scan(None, [], numels, codes, records, 4096, 2) is None
    assert check.check(None, []) is None
