"""The numba-cuda backend against the reference backend.

Without a GPU, its kernels run in numba's CUDA simulator, which must be switched on (NUMBA_ENABLE_CUDASIM=1) before
numba is imported: so one subprocess scans every case below through scan_bit_arrays (the same kernels and piece
planning, fed host arrays laid out as tensors lie in memory, with NaN guards between them) and this process compares
its records with the reference's. Launches there use few threads, few blocks and short pieces, so the simulator stays
fast and every tensor crosses pieces and blocks. Tests marked `cuda` scan real CUDA tensors with NumbaCudaBackend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import nanscan
from conftest import FLOAT8_DTYPES, BitTables, assert_records_match
from nanscan.engine import _layout as L
from nanscan.engine.backends import numba_cuda as B
from nanscan.engine.backends.reference import ReferenceBackend
from nanscan.engine.inputs import prepare

REPO_ROOT = Path(__file__).resolve().parents[1]

# Launch settings under the simulator, which runs every CUDA thread as a Python thread: few threads, and pieces short
# enough that tensors span pieces scanned by different blocks (their records then merge through global atomics).
SMALL_LAUNCH = {"threads": 4, "blocks": 3, "piece_elems": 37}
EXHAUSTIVE_LAUNCH = {"threads": 8, "blocks": 3, "piece_elems": 4096}


def _scaled_normals(dtype: torch.dtype, n: int, low: int, high: int, seed: int) -> torch.Tensor:
    """Normal samples times 2**k, k uniform in [low, high): values across many binades, subnormals and the
    histogram's clamped ends included when the range reaches them."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(low, high, (n,), generator=g, dtype=torch.float64)
    return (torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(exponents)).to(dtype)


def _special_and_powers(dtype: torch.dtype) -> torch.Tensor:
    """Signed zeros, subnormals, extremes, infinities and NaNs with payloads, then every binade boundary."""
    bits = np.concatenate([np.array(list(BitTables.special(dtype).values()), dtype=np.uint64),
                           BitTables.powers_of_two(dtype).astype(np.uint64)])
    return BitTables.tensor(bits, dtype)


def _planted(t: torch.Tensor, values: dict[int, float]) -> torch.Tensor:
    """A copy of `t` with values[i] written at element i."""
    t = t.clone()
    for index, value in values.items():
        t[index] = value
    return t


def _cases() -> dict[str, tuple[list[tuple[str, torch.Tensor]], dict]]:
    """name -> (tensors scanned in one call, launch settings under the simulator)."""
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    nan, inf = float("nan"), float("inf")
    return {
        "float16 every pattern": ([("float16 patterns", BitTables.all_patterns(f16))], EXHAUSTIVE_LAUNCH),
        "bfloat16 every pattern": ([("bfloat16 patterns", BitTables.all_patterns(bf16))], EXHAUSTIVE_LAUNCH),
        # Every float8 pattern in tensors of several lengths, across pieces (37 elements) and blocks.
        **{f"{dtype} every pattern": ([
            (f"{dtype} patterns", BitTables.all_patterns(dtype)),
            (f"{dtype} patterns three times, shifted", BitTables.all_patterns(dtype).repeat(3)[5:]),
            (f"{dtype} one pattern in 7", BitTables.all_patterns(dtype)[::7]),
        ], SMALL_LAUNCH) for dtype in FLOAT8_DTYPES},
        "float32 special values": ([("float32 specials", _special_and_powers(f32))], SMALL_LAUNCH),
        "float64 special values": ([("float64 specials", _special_and_powers(f64))], EXHAUSTIVE_LAUNCH),
        # Formats interleaved, so record rows and launch groups differ; empty tensors between the others.
        "mixed sizes and formats": ([
            ("float32 wide range", _planted(_scaled_normals(f32, 3001, -150, 128, 1), {17: nan, 2999: -inf})),
            ("bfloat16 one element", torch.tensor([-3.5], dtype=bf16)),
            ("float16 empty", torch.empty(0, dtype=f16)),
            ("float64 wide range", _scaled_normals(f64, 517, -1090, 1020, 2)),
            ("float32 empty", torch.empty(0, dtype=f32)),
            ("float16 wide range", _planted(_scaled_normals(f16, 1000, -26, 17, 3), {0: inf, 999: nan})),
            ("bfloat16 wide range", _planted(_scaled_normals(bf16, 2049, -140, 128, 4), {1000: 0.0, 1001: -0.0})),
            ("float64 moderate", _scaled_normals(f64, 300, -20, 20, 5)),
            ("float32 one element", torch.tensor([1e-45], dtype=f32)),
        ], SMALL_LAUNCH),
        "empty and degenerate": ([
            ("float32 empty", torch.empty(0, dtype=f32)),
            ("bfloat16 empty", torch.empty(0, dtype=bf16)),
            ("float16 signed zeros", torch.tensor([0.0, -0.0] * 20, dtype=f16)),
            ("float64 all NaN", torch.full((50,), nan, dtype=f64)),
            ("bfloat16 infinities only", torch.tensor([inf, -inf, -inf], dtype=bf16)),
        ], SMALL_LAUNCH),
    }


CASES = _cases()

SIMULATE = """
import json, sys
import numpy as np
from nanscan.engine.backends import numba_cuda as B
calls = json.loads(open(sys.argv[1]).read())
arrays = np.load(sys.argv[2], allow_pickle=False)
out = {}
for i, call in enumerate(calls):
    bits = [arrays[f"call{i}_tensor{k}"] for k in range(len(call["codes"]))]
    out[f"call{i}"] = B.scan_bit_arrays(bits, call["codes"], **call["launch"])
try:
    B.NumbaCudaBackend()
    out["backend_error"] = np.array("")
except RuntimeError as exc:
    out["backend_error"] = np.array(str(exc))
np.savez(sys.argv[3], **out)
"""


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    """Records of every case, scanned by the kernels in numba's CUDA simulator (one subprocess for all), and the
    error NumbaCudaBackend() gives there."""
    folder = tmp_path_factory.mktemp("numba_cuda_sim")
    calls, arrays = [], {}
    for i, (tensors, launch) in enumerate(CASES.values()):
        calls.append({"codes": [prepare(label, t).scanned_code for label, t in tensors], "launch": launch})
        for k, (_, t) in enumerate(tensors):
            arrays[f"call{i}_tensor{k}"] = BitTables.bits_of(t)
    (folder / "calls.json").write_text(json.dumps(calls))
    np.savez(folder / "inputs.npz", **arrays)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}  # `python -c` in REPO_ROOT imports this checkout's nanscan
    done = subprocess.run([sys.executable, "-c", SIMULATE, str(folder / "calls.json"), str(folder / "inputs.npz"),
                           str(folder / "records.npz")], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"the simulator run failed:\n{done.stdout}\n{done.stderr}"
    with np.load(folder / "records.npz", allow_pickle=False) as saved:
        results = {name: saved[f"call{i}"] for i, name in enumerate(CASES)}
        results["backend_error"] = str(saved["backend_error"])
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_simulated_kernels_match_reference(simulated, case):
    tensors, _ = CASES[case]
    inputs = [prepare(label, t) for label, t in tensors]
    want = ReferenceBackend().scan_records(inputs)
    assert_records_match(simulated[case], want, [label for label, _ in tensors],
                         label=f"numba-cuda kernels in the simulator ({case})")


def test_simulated_records_count_every_element(simulated):
    """Each record accounts for every element exactly once (no piece skipped or scanned twice, no guard read)."""
    for case, (tensors, _) in CASES.items():
        records = simulated[case]
        for row, (label, t) in enumerate(tensors):
            classes = records[row, [L.REC_NAN, L.REC_POSINF, L.REC_NEGINF, L.REC_ZERO]].sum()
            binned = records[row, L.REC_HIST:L.REC_HIST_END].sum()
            assert classes + binned == t.numel(), f"{case}: {label!r} counts {classes + binned} of {t.numel()}"


def test_backend_refuses_the_simulator(simulated):
    assert "NUMBA_ENABLE_CUDASIM" in simulated["backend_error"]


def _nvvm_missing() -> str:
    """Why numba cannot compile for a real GPU here ('' when it can: NVVM ships with the CUDA toolkit)."""
    try:
        from numba.cuda.cudadrv import nvvm  # noqa: PLC0415

        nvvm.NVVM()
    except Exception as exc:  # noqa: BLE001 - any failure to load NVVM means no PTX here
        return f"numba finds no NVVM to compile CUDA kernels: {type(exc).__name__}: {exc}"
    return ""


@pytest.mark.skipif(bool(_nvvm_missing()), reason=_nvvm_missing() or "NVVM present")
@pytest.mark.parametrize("code", sorted(L.DTYPE_NAMES), ids=L.DTYPE_NAMES.get)
def test_kernels_compile_for_a_real_gpu(code):
    """The simulator runs the kernels as Python and types nothing; here numba's CUDA target types and compiles them
    for sm_90 (no GPU needed). No float-to-integer conversion may appear: the bit arithmetic stays integer (numba
    turns uint64 mixed with int64 into float64, which would round bit patterns)."""
    from numba import cuda  # noqa: PLC0415

    bits = np.dtype(L.BITS_DTYPES[code]).name
    signature = f"void({bits}[::1], int64[:, ::1], int64[::1], float64[::1], int64[:, ::1], float64[::1])"
    ptx, _ = cuda.compile_ptx(B._kernel(code).py_func, signature, cc=(9, 0))
    assert ".entry" in ptx
    assert "cvt.rzi" not in ptx, "a bit pattern went through a float conversion"


# -- host-side planning ---------------------------------------------------------------------------------------------

def test_plan_group_cuts_each_tensor_into_consecutive_pieces():
    itemsize = 4
    base = 0x7F0000001000
    ptrs = np.array([base + 400, base, base + 4000, base + 800], dtype=np.int64)
    numels = np.array([25, 10, 0, 7], dtype=np.int64)
    rows = np.array([5, 2, 9, 0], dtype=np.int64)
    got_base, length, pieces = B.plan_group(ptrs, numels, rows, itemsize, piece_elems=8)
    assert got_base == base
    assert length == 200 + 7  # the tensor at base + 800 ends last; the empty one at base + 4000 is not read
    covered = {}
    for begin, end, row in pieces.tolist():
        assert 0 < end - begin <= 8
        covered.setdefault(row, []).append((begin, end))
    assert sorted(covered) == [0, 2, 5]  # no piece for the empty tensor
    for row, first, n in ((5, 100, 25), (2, 0, 10), (0, 200, 7)):
        spans = covered[row]
        assert spans[0][0] == first and spans[-1][1] == first + n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"row {row}: pieces {spans} leave gaps"


def test_plan_group_with_only_empty_tensors_has_no_pieces():
    base, length, pieces = B.plan_group(np.array([64, 128]), np.array([0, 0]), np.array([0, 1]), 2, 16)
    assert (base, length, pieces.shape) == (0, 0, (0, 3))


def test_plan_group_rejects_misaligned_tensors_and_bad_piece_lengths():
    with pytest.raises(ValueError, match=r"record row 7 .* not a multiple of its element size 8"):
        B.plan_group(np.array([0x1000, 0x2004]), np.array([3, 3]), np.array([6, 7]), 8, 16)
    with pytest.raises(ValueError, match="piece_elems=0"):
        B.plan_group(np.array([0x1000]), np.array([3]), np.array([0]), 8, 0)


def test_device_span_names_no_stream():
    """The arrays handed to numba name no stream, so numba adds no synchronization of its own to a launch."""
    t = torch.zeros((3, L.RECORD_WIDTH), dtype=torch.int64)
    interface = B._DeviceSpan.of(t).__cuda_array_interface__
    assert interface["stream"] is None
    assert interface["data"] == (t.data_ptr(), False)
    assert interface["shape"] == (3, L.RECORD_WIDTH) and interface["typestr"] == "<i8"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given where no GPU is present")
def test_backend_without_gpu_fails_cleanly():
    with pytest.raises(RuntimeError, match="torch.cuda.is_available|numba.cuda finds no usable GPU"):
        B.NumbaCudaBackend()


def test_a_numba_cuda_that_cannot_compile_makes_the_backend_unavailable(monkeypatch):
    """numba-cuda can import and see the GPU, yet fail at the first compile (on one image: a numba-cuda older than
    its numpy, AttributeError: numpy has no 'row_stack'); the load-time probe turns that into unavailability, so
    auto selection moves on instead of every scan failing."""
    monkeypatch.setattr(B.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(B.cuda, "is_available", lambda: True)

    def broken(self, inputs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(B.NumbaCudaBackend, "scan_records", broken)
    monkeypatch.setattr(B.torch.cuda, "current_device", lambda: 0)
    cpu_tensor = torch.tensor
    monkeypatch.setattr(B.torch, "tensor", lambda data, **kwargs: cpu_tensor(data))  # no CUDA here: a CPU probe
    with pytest.raises(RuntimeError, match="cannot compile or run nanscan's kernels here .AttributeError: module "
                                           "'numpy' has no attribute 'row_stack'"):
        B.NumbaCudaBackend()


# -- on a GPU -------------------------------------------------------------------------------------------------------

def _gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA GPU (torch.cuda.is_available() is False)"
    from numba import cuda  # noqa: PLC0415 - only asked where torch sees a GPU

    if not cuda.is_available():
        return False, f"numba.cuda finds no GPU: {cuda.cuda_error()}"
    return True, ""


def gpu_test(fn):
    ready, reason = _gpu_ready()
    return pytest.mark.cuda(pytest.mark.skipif(not ready, reason=reason)(fn))


@gpu_test
@pytest.mark.parametrize("settings", [{}, {"threads": 32, "blocks": 2, "piece_elems": 1000}],
                         ids=["default launch", "two blocks, short pieces"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_matches_reference(case, settings):
    tensors, _ = CASES[case]
    inputs = [prepare(label, t.cuda()) for label, t in tensors]
    got = B.NumbaCudaBackend(**settings).scan_records(inputs)
    want = ReferenceBackend().scan_records(inputs)
    assert_records_match(got, want, [label for label, _ in tensors], label=f"numba-cuda on the GPU ({case})")


@gpu_test
def test_gpu_bf16_weights_with_planted_nan():
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {f"layer{i}.weight": (torch.randn(shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
               for i, shape in enumerate([(1024, 4096), (4096, 1024), (50_000, 64), (7,)])}
    weights["layer1.weight"][123, 456] = float("nan")
    weights["layer2.weight.T"] = weights["layer2.weight"].t()  # a permuted view, read in place
    weights["layer0.weight[:, ::3]"] = weights["layer0.weight"][:, ::3]  # a view with gaps, compacted first
    report = nanscan.scan(weights, backend=B.NumbaCudaBackend())
    reference = nanscan.scan(weights, backend="reference")
    assert report.backend == "numba-cuda"
    assert_records_match(report.records, reference.records, report.names, label="numba-cuda on bf16 weights")
    assert report.records[:, L.REC_NAN].tolist() == [0, 1, 0, 0, 0, 0]


@gpu_test
def test_gpu_scan_runs_on_the_current_stream():
    """A NaN written on a side stream, after a long sleep there, is seen by a scan made on that stream without any
    synchronization: the kernels are ordered after the write rather than racing it on another stream."""
    x = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")
    backend = B.NumbaCudaBackend()
    backend.scan_records([prepare("x", x)])  # compiles the kernel before the timed part
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time before the write
        x[12345] = float("nan")
        records = backend.scan_records([prepare("x", x)])
    assert records[0, L.REC_NAN] == 1
