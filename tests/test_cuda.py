"""The CUDA scan against the reference. Tests marked `cuda` run the kernel on a GPU and are skipped without one;
the others run the kernel's own per-thread code on the CPU (scan_records_on_host), so machines without a GPU
still check the chunk table, the head/vector/tail split, the fast-path decision and the field table."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

import nanscan
from nanscan import _layout as L
from nanscan._cuda_backend import (CHUNK_META_DTYPE, DEFAULT_CHUNK_BYTES, build_chunk_table, scan_records_on_host)
from nanscan._reference import ReferenceBackend
from nanscan.inputs import prepare

try:
    from nanscan import _C
except ImportError:  # the extension failed to build: nanscan runs on numba/reference, and nothing here applies
    _C = None

HAS_CUDA_BUILD = _C is not None and hasattr(_C, "scan_cuda")
HAS_GPU = torch.cuda.is_available()

needs_cuda_build = pytest.mark.skipif(not HAS_CUDA_BUILD, reason="nanscan._C was built without its CUDA part")


def gpu_test(fn):
    """Marks a test `cuda` and skips it, saying why, where there is no GPU or no CUDA build to run it."""
    reason = "no CUDA GPU (torch.cuda.is_available() is False)" if not HAS_GPU else "nanscan._C has no CUDA part"
    return pytest.mark.cuda(pytest.mark.skipif(not (HAS_GPU and HAS_CUDA_BUILD), reason=reason)(fn))

INT_SLOTS = np.array([k for k in range(L.RECORD_WIDTH) if k != L.REC_SUMSQ])

# Raw bit patterns of the values every backend must get right, per format: signed zeros, subnormals (smallest,
# largest, negative), normals at both ends of the range, infinities, quiet NaNs with and without payload and
# sign, and signalling NaNs.
SPECIAL_BITS = {
    torch.float32: [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x80000001, 0x00800000, 0x80800000, 0x3F800000,
                    0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001,
                    0x7FBFFFFF, 0xFF800001],
    torch.float64: [0x0, 0x8000000000000000, 0x1, 0x000FFFFFFFFFFFFF, 0x8000000000000001, 0x0010000000000000,
                    0x8010000000000000, 0x3FF0000000000000, 0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF,
                    0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0xFFF8000000000000,
                    0x7FF8000000012345, 0x7FF0000000000001, 0x7FF7FFFFFFFFFFFF, 0xFFF0000000000001],
}
_BITS_NP = {torch.float32: (np.uint32, np.float32), torch.float64: (np.uint64, np.float64)}


def assert_same_records(got: np.ndarray, want: np.ndarray, names) -> None:
    """Every count, extreme and bin equal; the float64 sum of squares equal up to summation order."""
    assert got.shape == want.shape
    for i, name in enumerate(names):
        diff = np.flatnonzero(got[i, INT_SLOTS] != want[i, INT_SLOTS])
        assert not len(diff), (f"{name}: slots {INT_SLOTS[diff].tolist()} differ: got {got[i, INT_SLOTS[diff]]}, "
                               f"reference {want[i, INT_SLOTS[diff]]}")
        got_sumsq = float(got[i, L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0])
        want_sumsq = float(want[i, L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0])
        assert math.isclose(got_sumsq, want_sumsq, rel_tol=1e-12, abs_tol=0.0), (name, got_sumsq, want_sumsq)


def reference(inputs) -> np.ndarray:
    return ReferenceBackend().scan_records(inputs)


def all_bit_patterns(dtype: torch.dtype, device="cpu") -> torch.Tensor:
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).to(device)


def special_value_tensors(dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Each special value at every position of a run of random normals, from offsets that move it through the head,
    the vectors and the tail of a chunk: one tensor per (value, position)."""
    bits_np, float_np = _BITS_NP[dtype]
    gen = torch.Generator().manual_seed(7)
    out = {}
    for bits in SPECIAL_BITS[dtype]:
        value = torch.from_numpy(np.array([bits], dtype=bits_np).view(float_np))
        for pos in range(0, 40, 3):
            t = torch.randn(41, generator=gen, dtype=dtype)
            t[pos] = value[0]
            out[f"{dtype}:{bits:#x}@{pos}"] = t.to(device)
    return out


def mixed_tensors(device="cpu") -> dict[str, torch.Tensor]:
    """Many tensors of every dtype and awkward sizes, with zeros, subnormals, infinities and NaNs sprinkled in."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    sizes = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 255, 1000, 4097, 65537]
    for i, (dtype, size) in enumerate((d, s) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                                      for s in sizes):
        t = (torch.randn(size, generator=gen) * 10.0 ** (i % 7 - 3)).to(dtype)
        if size > 20:
            picks = torch.randint(0, size, (6,), generator=gen)
            t[picks[0]] = 0.0
            t[picks[1]] = -0.0
            t[picks[2]] = torch.finfo(dtype).tiny / 4  # subnormal
            if i % 3 == 0:
                t[picks[3]] = float("nan")
            if i % 4 == 1:
                t[picks[4]] = float("inf")
            if i % 5 == 2:
                t[picks[5]] = float("-inf")
        out[f"{dtype}[{size}]#{i}"] = t.to(device)
    return out


def misaligned_views(device="cpu") -> dict[str, torch.Tensor]:
    """Views starting 1..7 elements into their storage, so no vector of the chunk is 16-byte aligned at its start."""
    gen = torch.Generator().manual_seed(11)
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        base = torch.randn(3000, generator=gen).to(dtype)
        base[::97] = 0.0
        base[5::211] = float("nan")
        base = base.to(device)
        for offset in range(1, 8):
            for length in (0, 1, 5, 29, 2000):
                out[f"{dtype}+{offset}[{length}]"] = base[offset:offset + length]
    return out


def inputs_of(tensors: dict[str, torch.Tensor]):
    return [prepare(name, t) for name, t in tensors.items()]


# -- the build --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH, so the CUDA part is not built")
@pytest.mark.skipif(_C is None, reason="nanscan._C did not build")
def test_extension_has_cuda_when_nvcc_is_on_path():
    info = _C.build_info()
    assert info["cuda"] is True, "setup.py found no nvcc, or failed to compile csrc/cuda: see the pip build log"
    assert info["cuda_arch"]
    assert hasattr(_C, "scan_cuda") and hasattr(_C, "cuda_probe")


@needs_cuda_build
def test_chunk_table_layout_matches_the_kernel():
    layout = _C.cuda_layout()
    assert layout["chunk_meta_itemsize"] == CHUNK_META_DTYPE.itemsize == 32
    assert layout["chunk_meta_offsets"] == {n: CHUNK_META_DTYPE.fields[n][1] for n in CHUNK_META_DTYPE.names}
    assert layout["max_chunk_elems"] >= DEFAULT_CHUNK_BYTES // 2


# -- the chunk table ----------------------------------------------------------------------------------------------

def test_chunk_table_covers_every_element_once():
    ptrs = np.array([0x1000, 0x2002, 0x3004, 0x4008], dtype=np.uint64)
    numels = np.array([100, 0, 33, 7], dtype=np.int64)
    codes = np.array([L.BFLOAT16, L.FLOAT16, L.FLOAT32, L.FLOAT64], dtype=np.int32)
    table = build_chunk_table(ptrs, numels, codes, chunk_bytes=32, max_chunk_elems=1 << 20)
    for t, (ptr, numel, code) in enumerate(zip(ptrs, numels, codes)):
        rows = table[table["tensor"] == t]
        assert (rows["data"] == ptr).all() and (rows["dtype"] == code).all()
        covered = np.zeros(numel, dtype=int)
        for row in rows:
            assert row["end"] - row["begin"] <= 32 // [2, 2, 4, 8][code]
            covered[row["begin"]:row["end"]] += 1
        assert (covered == 1).all()
    assert not (table["tensor"] == 1).any(), "an empty tensor gets no chunk"


def test_chunk_table_caps_chunks_and_rejects_bad_input():
    table = build_chunk_table(np.array([0x100], np.uint64), np.array([1000]), np.array([L.FLOAT32]),
                              chunk_bytes=1 << 20, max_chunk_elems=64)
    assert (table["end"] - table["begin"]).max() == 64 and len(table) == 16
    with pytest.raises(ValueError, match="element size"):
        build_chunk_table(np.array([0x101], np.uint64), np.array([4]), np.array([L.FLOAT32]), chunk_bytes=64,
                          max_chunk_elems=64)
    with pytest.raises(ValueError, match="multiple of 16"):
        build_chunk_table(np.array([0x100], np.uint64), np.array([4]), np.array([L.FLOAT32]), chunk_bytes=24,
                          max_chunk_elems=64)
    with pytest.raises(ValueError, match="unknown dtype code"):
        build_chunk_table(np.array([0x100], np.uint64), np.array([4]), np.array([9]), chunk_bytes=64,
                          max_chunk_elems=64)


# -- the kernel's per-thread code, run on the CPU ------------------------------------------------------------------

@needs_cuda_build
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096, 16])
def test_host_run_all_16bit_patterns(dtype, chunk_bytes):
    inputs = inputs_of({"all": all_bit_patterns(dtype), "shifted": all_bit_patterns(dtype)[3:]})
    assert_same_records(scan_records_on_host(inputs, chunk_bytes=chunk_bytes), reference(inputs),
                        [i.name for i in inputs])


@needs_cuda_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_run_special_values(dtype):
    inputs = inputs_of(special_value_tensors(dtype))
    assert_same_records(scan_records_on_host(inputs), reference(inputs), [i.name for i in inputs])


@needs_cuda_build
def test_host_run_mixed_dtypes_in_one_call():
    inputs = inputs_of(mixed_tensors())
    got = scan_records_on_host(inputs, chunk_bytes=1024)
    assert_same_records(got, reference(inputs), [i.name for i in inputs])
    assert got[:, L.REC_NAN].sum() > 0 and got[:, L.REC_SUBNORMAL].sum() > 0  # the data did exercise them


@needs_cuda_build
def test_host_run_misaligned_views_and_empty_tensors():
    inputs = inputs_of(misaligned_views())
    assert_same_records(scan_records_on_host(inputs, chunk_bytes=256), reference(inputs), [i.name for i in inputs])


@needs_cuda_build
def test_host_run_zero_heavy_vectors_take_the_fast_path_exactly():
    # Zeros share vectors with normals (the fast path counts them in field slot 0; float64 counts them apart).
    tensors = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = torch.zeros(4099, dtype=dtype)
        t[::3] = torch.linspace(-5, 5, len(t[::3])).to(dtype)
        tensors[str(dtype)] = t
        tensors[f"{dtype} zeros"] = torch.zeros(1000, dtype=dtype)
        tensors[f"{dtype} subnormals"] = torch.full((1000,), torch.finfo(dtype).tiny / 8, dtype=dtype)
    inputs = inputs_of(tensors)
    assert_same_records(scan_records_on_host(inputs), reference(inputs), [i.name for i in inputs])


@needs_cuda_build
def test_host_run_chunk_longer_than_one_pass():
    # A chunk longer than max_chunk_elems is scanned in several passes, each flushing the 16-bit field table.
    max_elems = _C.cuda_layout()["max_chunk_elems"]
    t = torch.randn(2 * max_elems + 13, dtype=torch.bfloat16)
    t[max_elems + 1] = float("nan")
    table = build_chunk_table(np.array([t.data_ptr()], np.uint64), np.array([t.numel()]), np.array([L.BFLOAT16]),
                              chunk_bytes=1 << 30, max_chunk_elems=1 << 40)
    assert len(table) == 1
    records = np.empty((1, L.RECORD_WIDTH), dtype=np.int64)
    _C.scan_cuda_on_host(table.view(np.uint8), records)
    inputs = inputs_of({"long": t})
    assert_same_records(records, reference(inputs), ["long"])


@needs_cuda_build
def test_host_run_rejects_a_bad_table():
    table = np.zeros(1, dtype=CHUNK_META_DTYPE)
    table["tensor"] = 5
    with pytest.raises(ValueError, match="out of range"):
        _C.scan_cuda_on_host(table.view(np.uint8), np.empty((1, L.RECORD_WIDTH), dtype=np.int64))


# -- the kernel on a GPU -------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_backend():
    from nanscan._cuda_backend import CudaBackend
    return CudaBackend()


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096])
def test_gpu_all_16bit_patterns(dtype, chunk_bytes):
    from nanscan._cuda_backend import CudaBackend
    inputs = inputs_of({"all": all_bit_patterns(dtype, "cuda"), "shifted": all_bit_patterns(dtype, "cuda")[3:]})
    got = CudaBackend(chunk_bytes=chunk_bytes).scan_records(inputs)
    assert_same_records(got, reference(inputs), [i.name for i in inputs])


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpu_special_values(dtype, cuda_backend):
    inputs = inputs_of(special_value_tensors(dtype, "cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
def test_gpu_mixed_dtypes_in_one_call(cuda_backend):
    inputs = inputs_of(mixed_tensors("cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
def test_gpu_misaligned_views_and_empty_tensors(cuda_backend):
    inputs = inputs_of(misaligned_views("cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
def test_gpu_large_tensors_many_chunks_and_passes(cuda_backend):
    gen = torch.Generator(device="cuda").manual_seed(5)
    big = torch.randn(5_000_011, generator=gen, device="cuda").to(torch.bfloat16)
    big[4_999_999] = float("-inf")
    wide = torch.randn(1_500_000, generator=gen, device="cuda", dtype=torch.float64)
    inputs = inputs_of({"big": big, "wide": wide})
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), ["big", "wide"])
    # One chunk of 3M elements: the kernel splits it into passes of max_chunk_elems.
    table = build_chunk_table(np.array([big.data_ptr()], np.uint64), np.array([3_000_000]), np.array([L.BFLOAT16]),
                              chunk_bytes=1 << 30, max_chunk_elems=1 << 40)
    device_table = torch.from_numpy(table.view(np.uint8)).cuda()
    records = torch.empty((1, L.RECORD_WIDTH), dtype=torch.int64, device="cuda")
    found_inf = torch.empty((), dtype=torch.float32, device="cuda")
    _C.scan_cuda(device_table.data_ptr(), 1, records.data_ptr(), 1, found_inf.data_ptr(),
                 torch.cuda.current_stream().cuda_stream, big.device.index)
    assert_same_records(records.cpu().numpy(), reference(inputs_of({"head": big[:3_000_000]})), ["head"])
    assert found_inf.item() == 0.0


@gpu_test
def test_gpu_counts_are_deterministic(cuda_backend):
    inputs = inputs_of(mixed_tensors("cuda"))
    runs = [cuda_backend.scan_records(inputs).copy() for _ in range(3)]
    for other in runs[1:]:
        assert (other[:, INT_SLOTS] == runs[0][:, INT_SLOTS]).all()


@gpu_test
def test_gpu_async_records_equal_sync_and_found_inf(cuda_backend):
    tensors = mixed_tensors("cuda")
    inputs = inputs_of(tensors)
    pending = cuda_backend.scan_async(inputs)
    assert pending.found_inf.device.type == "cuda" and pending.found_inf.dtype == torch.float32
    assert_same_records(pending.records(), cuda_backend.scan_records(inputs), [i.name for i in inputs])
    assert pending.ready()
    assert pending.found_inf.item() == 1.0  # mixed_tensors plants NaN and inf

    clean = inputs_of({k: torch.nan_to_num(v, nan=0.0, posinf=1.0, neginf=-1.0) for k, v in tensors.items()})
    healthy = cuda_backend.scan_async(clean)
    assert healthy.found_inf.item() == 0.0
    assert not healthy.records()[:, L.REC_NAN:L.REC_NEGINF + 1].any()


@gpu_test
def test_gpu_async_on_a_side_stream(cuda_backend):
    x = torch.randn(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    pending = cuda_backend.scan_async(inputs_of({"x": x}), stream=side)
    assert_same_records(pending.records(), reference(inputs_of({"x": x})), ["x"])


@gpu_test
def test_gpu_async_loop_never_synchronizes(cuda_backend):
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    inputs = inputs_of(dict(model.named_parameters()))
    cuda_backend.scan_async(inputs).records()  # warm-up: pinned-memory pools, first-call setup
    pending = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            pending.append(cuda_backend.scan_async(inputs))
            pending[-1].ready()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(not p.records()[:, :L.REC_NEGINF + 1].any() for p in pending)


@gpu_test
def test_gpu_found_inf_skips_a_fused_adamw_step(cuda_backend):
    w = torch.nn.Parameter(torch.ones(64, device="cuda"))
    w.grad = torch.ones_like(w)
    w.grad[3] = float("nan")
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    opt.found_inf = cuda_backend.scan_async(inputs_of({"grad": w.grad})).found_inf
    opt.grad_scale = None
    opt.step()
    assert torch.equal(w.detach(), torch.ones_like(w)), "found_inf=1.0 must make the fused step a no-op"


@gpu_test
def test_gpu_scan_api_uses_the_cuda_backend():
    report = nanscan.scan({"x": torch.tensor([1.0, float("nan"), 0.0], device="cuda")}, backend="cuda")
    assert report.backend == "cuda" and not report.ok and report["x"].nan == 1 and report["x"].zero == 1

