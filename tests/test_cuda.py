"""The CUDA scan against the reference. Tests marked `cuda` run the kernel on a GPU and are skipped without one;
the others run the kernel's own per-thread code on the CPU (scan_records_on_host), so machines without a GPU
still check the chunk table, the head/vector/tail split, the fast-path decision and the field table."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch

import nanscan
from conftest import FLOAT8_DTYPES
from nanscan.engine import _layout as L
from nanscan.engine.backends.cuda import CHUNK_META_DTYPE, build_chunk_table, scan_records_on_host
from nanscan.engine.backends.reference import ReferenceBackend
from nanscan.engine.inputs import prepare

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


def float8_pattern_tensors(dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Every pattern of a float8 format, repeated, at offsets 0..16 into the storage (so head, 16-byte vectors and
    tail all see every pattern, the fnuz NaN 0x80 inside a vector included), and each pattern in a vector of ones."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    gen = torch.Generator().manual_seed(8)
    base = torch.cat([patterns, patterns[torch.randperm(256, generator=gen)], patterns.flip(0)]).repeat(3)
    out = {f"offset {k}": base[k:].view(dtype).to(device) for k in range(17)}
    one = int(torch.tensor([1.0]).to(dtype).view(torch.uint8))
    for bits in range(256):
        t = torch.full((48,), one, dtype=torch.uint8)
        t[16 + bits % 16] = bits
        out[f"{bits:#04x} among ones"] = t.view(dtype).to(device)
    return out


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
@pytest.mark.skipif(os.environ.get("NANSCAN_CUDA", "").lower() in ("0", "false", "no", "off"),
                    reason="NANSCAN_CUDA=0 turns the CUDA part of the build off")
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
    assert layout["max_chunk_elems"] >= 1 << 20


# -- the work list -------------------------------------------------------------------------------------------------

def check_work_list(table, block_begin, numels, max_chunk_elems):
    """Every element of every tensor in exactly one piece, pieces within their limits, blocks in order."""
    assert block_begin[0] == 0 and block_begin[-1] == len(table) and (np.diff(block_begin) >= 0).all()
    assert (table["end"] > table["begin"]).all() and (table["end"] - table["begin"] <= max_chunk_elems).all()
    order = np.lexsort((table["begin"], table["tensor"]))
    assert (order == np.arange(len(table))).all(), "pieces are listed in tensor order"
    for t, numel in enumerate(numels):
        rows = table[table["tensor"] == t]
        covered = np.zeros(numel, dtype=int)
        for row in rows:
            covered[row["begin"]:row["end"]] += 1
        assert (covered == 1).all(), f"tensor {t}"


def test_work_list_covers_every_element_once_and_balances_blocks():
    gen = np.random.default_rng(0)
    numels = gen.integers(0, 5000, size=60)
    numels[[3, 17]] = 0
    numels[5] = 200_003
    codes = gen.integers(0, 4, size=60).astype(np.int32)
    offsets = 8 * gen.integers(0, 9, size=60)  # element-aligned for every dtype, not always 16-byte aligned
    ptrs = (np.arange(60, dtype=np.uint64) << np.uint64(24)) + offsets.astype(np.uint64)
    table, block_begin = build_chunk_table(ptrs, numels, codes, max_blocks=16, max_chunk_elems=1 << 16,
                                           piece_cost_bytes=256, min_block_bytes=1024)
    check_work_list(table, block_begin, numels, 1 << 16)
    assert len(block_begin) == 17
    sizes = np.array([2, 2, 4, 8])[table["dtype"]]
    cost = [int(((table["end"] - table["begin"]) * sizes)[block_begin[b]:block_begin[b + 1]].sum()
                + 256 * (block_begin[b + 1] - block_begin[b])) for b in range(16)]
    assert max(cost) < 1.1 * sum(cost) / 16, cost  # shares of equal cost, give or take one piece's rounding
    assert (table["data"] == ptrs[table["tensor"]]).all() and (table["dtype"] == codes[table["tensor"]]).all()


def test_work_list_small_and_empty_inputs():
    table, block_begin = build_chunk_table(np.array([0x100], np.uint64), np.array([10]), np.array([L.FLOAT32]),
                                           max_blocks=132, max_chunk_elems=1 << 20)
    assert len(table) == 1 and list(block_begin) == [0, 1], "a small scan uses one block"
    table, block_begin = build_chunk_table(np.array([0x100, 0x200], np.uint64), np.array([0, 0]),
                                           np.array([L.FLOAT32, L.FLOAT16]), max_blocks=132, max_chunk_elems=1 << 20)
    assert len(table) == 0 and list(block_begin) == [0]
    table, block_begin = build_chunk_table(np.array([0x100], np.uint64), np.array([1000]), np.array([L.FLOAT64]),
                                           max_blocks=4, max_chunk_elems=64, min_block_bytes=16)
    check_work_list(table, block_begin, [1000], 64)
    table, block_begin = build_chunk_table(np.array([0x100, 0x1000], np.uint64), np.array([100, 100]),
                                           np.array([L.FLOAT16, L.FLOAT64]), max_blocks=1, max_chunk_elems=64,
                                           max_chunk_bytes=32)
    check_work_list(table, block_begin, [100, 100], 64)
    assert ((table["end"] - table["begin"]) * np.array([2, 2, 4, 8])[table["dtype"]]).max() == 32


def test_work_list_rejects_bad_input():
    one = dict(max_blocks=4, max_chunk_elems=64)
    with pytest.raises(ValueError, match="element size"):
        build_chunk_table(np.array([0x101], np.uint64), np.array([4]), np.array([L.FLOAT32]), **one)
    with pytest.raises(ValueError, match="unknown dtype code"):
        build_chunk_table(np.array([0x100], np.uint64), np.array([4]), np.array([9]), **one)
    with pytest.raises(ValueError, match="max_blocks"):
        build_chunk_table(np.array([0x100], np.uint64), np.array([4]), np.array([L.FLOAT32]), max_blocks=0,
                          max_chunk_elems=64)


# -- the kernel's per-thread code, run on the CPU ------------------------------------------------------------------

@needs_cuda_build
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("max_blocks", [1, 7, 300])
def test_host_run_all_16bit_patterns(dtype, max_blocks):
    inputs = inputs_of({"all": all_bit_patterns(dtype), "shifted": all_bit_patterns(dtype)[3:]})
    got = scan_records_on_host(inputs, max_blocks=max_blocks, min_block_bytes=1024)
    assert_same_records(got, reference(inputs), [i.name for i in inputs])


@needs_cuda_build
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("max_blocks", [1, 5])
def test_host_run_every_float8_pattern(dtype, max_blocks):
    inputs = inputs_of(float8_pattern_tensors(dtype))
    got = scan_records_on_host(inputs, max_blocks=max_blocks, min_block_bytes=64)
    assert_same_records(got, reference(inputs), [i.name for i in inputs])


@needs_cuda_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_run_special_values(dtype):
    inputs = inputs_of(special_value_tensors(dtype))
    assert_same_records(scan_records_on_host(inputs), reference(inputs), [i.name for i in inputs])


@needs_cuda_build
def test_host_run_mixed_dtypes_in_one_call():
    inputs = inputs_of(mixed_tensors())
    got = scan_records_on_host(inputs, max_blocks=13, min_block_bytes=4096)
    assert_same_records(got, reference(inputs), [i.name for i in inputs])
    assert got[:, L.REC_NAN].sum() > 0 and got[:, L.REC_SUBNORMAL].sum() > 0  # the data did exercise them


@needs_cuda_build
def test_host_run_misaligned_views_and_empty_tensors():
    inputs = inputs_of(misaligned_views())
    got = scan_records_on_host(inputs, max_blocks=9, min_block_bytes=512)
    assert_same_records(got, reference(inputs), [i.name for i in inputs])


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
def test_host_run_pieces_split_at_max_chunk_elems():
    t = torch.randn(70_001, dtype=torch.bfloat16)
    t[40_000] = float("nan")
    table, block_begin = build_chunk_table(np.array([t.data_ptr()], np.uint64), np.array([t.numel()]),
                                           np.array([L.BFLOAT16]), max_blocks=3, max_chunk_elems=1000,
                                           min_block_bytes=16)
    assert len(table) > 70
    records = np.empty((1, L.RECORD_WIDTH), dtype=np.int64)
    _C.scan_cuda_on_host(table.view(np.uint8), block_begin, records)
    assert_same_records(records, reference(inputs_of({"t": t})), ["t"])


@needs_cuda_build
def test_host_run_rejects_a_bad_table():
    table = np.zeros(1, dtype=CHUNK_META_DTYPE)
    table["tensor"] = 5
    records = np.empty((1, L.RECORD_WIDTH), dtype=np.int64)
    with pytest.raises(ValueError, match="out of range"):
        _C.scan_cuda_on_host(table.view(np.uint8), np.array([0, 1]), records)
    with pytest.raises(ValueError, match="block_begin"):
        _C.scan_cuda_on_host(table.view(np.uint8), np.array([0, 2]), records)


# -- the kernel on a GPU -------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_backend():
    from nanscan.engine.backends.cuda import CudaBackend
    return CudaBackend()


@pytest.fixture(params=["one block", "many blocks"])
def block_sizes(request, monkeypatch):
    """As shipped (these small inputs fit one block), and with tiny shares, so that many blocks split each tensor."""
    if request.param == "many blocks":
        monkeypatch.setattr("nanscan.engine.backends.cuda.MIN_BLOCK_BYTES", 1024)
        monkeypatch.setattr("nanscan.engine.backends.cuda.PIECE_COST_BYTES", 64)
    return request.param


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_all_16bit_patterns(dtype, cuda_backend, block_sizes):
    inputs = inputs_of({"all": all_bit_patterns(dtype, "cuda"), "shifted": all_bit_patterns(dtype, "cuda")[3:]})
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_gpu_every_float8_pattern(dtype, cuda_backend, block_sizes):
    inputs = inputs_of(float8_pattern_tensors(dtype, "cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpu_special_values(dtype, cuda_backend):
    inputs = inputs_of(special_value_tensors(dtype, "cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
def test_gpu_mixed_dtypes_in_one_call(cuda_backend, block_sizes):
    inputs = inputs_of(mixed_tensors("cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
def test_gpu_misaligned_views_and_empty_tensors(cuda_backend, block_sizes):
    inputs = inputs_of(misaligned_views("cuda"))
    assert_same_records(cuda_backend.scan_records(inputs), reference(inputs), [i.name for i in inputs])


@gpu_test
def test_gpu_large_tensors_on_every_block(cuda_backend):
    gen = torch.Generator(device="cuda").manual_seed(5)
    big = torch.randn(50_000_011, generator=gen, device="cuda").to(torch.bfloat16)
    big[49_999_999] = float("-inf")
    wide = torch.randn(3_000_001, generator=gen, device="cuda", dtype=torch.float64)
    inputs = inputs_of({"big": big, "wide": wide[1:]})
    pending = cuda_backend.scan_async(inputs)
    assert_same_records(pending.records(), reference(inputs), ["big", "wide"])
    assert pending.found_inf.item() == 1.0


@gpu_test
def test_gpu_raw_entry_point_with_a_hand_made_work_list():
    # Pieces of at most 1000 elements over 5 blocks, through _C.scan_cuda itself.
    x = torch.randn(123_457, device="cuda", dtype=torch.float32)
    table, block_begin = build_chunk_table(np.array([x.data_ptr()], np.uint64), np.array([x.numel()]),
                                           np.array([L.FLOAT32]), max_blocks=5, max_chunk_elems=1000,
                                           min_block_bytes=16)
    work = torch.from_numpy(np.concatenate([table.view(np.uint8), block_begin.view(np.uint8)])).cuda()
    records = torch.empty((1, L.RECORD_WIDTH), dtype=torch.int64, device="cuda")
    found_inf = torch.full((), 7.0, device="cuda")
    _C.scan_cuda(work.data_ptr(), len(table), work.data_ptr() + table.nbytes, len(block_begin) - 1,
                 records.data_ptr(), 1, found_inf.data_ptr(), torch.cuda.current_stream().cuda_stream,
                 x.device.index)
    assert_same_records(records.cpu().numpy(), reference(inputs_of({"x": x})), ["x"])
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

