"""The float8 scan paths against the reference, exhaustively: the C++ kernel's vector path (NOTE: [byte vectors] in
csrc/cpu/scan_cpu.cpp) and its per-pattern path (NOTE: [byte formats]), and the numba backend's byte scan.

Every one of the 256 patterns of each format sits at a random place inside blocks of finite values (so each pattern
is classified by the vector tables, and each non-finite one sends its block to the per-pattern path); tensors of
every length from 0 to 130 elements, and of two blocks and 0..130 more, start at random offsets into one buffer (so
the last vector is cut short at every length and the loads are unaligned); chunks of a few elements, of a few
blocks and one chunk per tensor split the same tensors; and a chunk of more than kWordBlocks blocks of one field
fills the 16-bit field counters as full as they get before they are spilled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nanscan
from conftest import FLOAT8_DTYPES, BitTables, assert_records_match
from nanscan.engine import _layout as L

BLOCK = 4096  # kBlockBytes: a block of float8 is 4096 elements


def finite_patterns(dtype: torch.dtype) -> np.ndarray:
    """The bit patterns of the finite values of `dtype`, decided by the reference's own decoding (torch)."""
    values = BitTables.all_patterns(dtype).to(torch.float64)
    return np.flatnonzero(torch.isfinite(values).numpy()).astype(np.uint8)


def subnormal_patterns(dtype: torch.dtype) -> np.ndarray:
    """The bit patterns of the subnormals of `dtype`, each mantissa positive then negative."""
    mant_bits = L.FORMATS[L.DTYPE_CODES[str(dtype).removeprefix("torch.")]].mant_bits
    return np.array([b | s for b in range(1, 1 << mant_bits) for s in (0, 0x80)], np.uint8)


def background(dtype: torch.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """n finite elements spread as a float8 recipe spreads them: Gaussian values scaled to the format's largest,
    with their zeros and subnormals, as raw bits."""
    x = rng.standard_normal(n)
    x *= float(torch.finfo(dtype).max) / max(np.abs(x).max(), 1e-300)
    return BitTables.bits_of(torch.from_numpy(x).to(dtype))


def scan_both(tensors: dict[str, torch.Tensor], backend, label: str) -> nanscan.ScanReport:
    report = nanscan.scan(tensors, backend=backend)
    reference = nanscan.scan(tensors, backend="reference")
    assert_records_match(report.records, reference.records, report.names, label=label)
    return report


def backend_for(name: str, chunk: int | None):
    if name == "cpu":
        return (nanscan.engine.backends.CpuBackend() if chunk is None
                else nanscan.engine.backends.CpuBackend(chunk_elems=chunk))
    from nanscan.engine.backends.numba_cpu import NumbaBackend

    return NumbaBackend() if chunk is None else NumbaBackend(chunk_elems=chunk)


def planted_patterns(dtype: torch.dtype, n: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """One tensor per bit pattern: n finite elements with that pattern at a random place."""
    tensors = {}
    for bits in range(256):
        t = background(dtype, n, rng)
        t[rng.integers(0, n)] = bits
        tensors[f"pattern {bits:#04x}"] = BitTables.tensor(t, dtype)
    return tensors


def float8_path_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A smaller set for the portable build's check (tests/test_native_build.py): every pattern planted in a block
    and a half, and a few lengths around a vector."""
    rng = np.random.default_rng(5)
    tensors = planted_patterns(dtype, BLOCK + BLOCK // 2, rng)
    whole = BitTables.tensor(background(dtype, 2 * BLOCK, rng), dtype)
    tensors.update({f"{length} elements": whole[length:2 * length] for length in (0, 1, 63, 64, 65, 130)})
    return tensors


@pytest.fixture(params=["cpu", "numba"])
def byte_backend(request):
    request.getfixturevalue(f"{request.param}_backend")  # skips, saying why, a backend that cannot run here
    return request.param


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [None, 3 * BLOCK + 5, 7])
def test_every_pattern_inside_finite_blocks(byte_backend, dtype, chunk):
    tensors = planted_patterns(dtype, 2 * BLOCK + 37, np.random.default_rng(30))
    report = scan_both(tensors, backend_for(byte_backend, chunk), f"{byte_backend}, chunks of {chunk}")
    nonfinite = [bits for bits in range(256) if bits not in set(finite_patterns(dtype).tolist())]
    for bits in nonfinite:  # the planted value is there, and counted where the reference counts it
        stats = report[f"pattern {bits:#04x}"]
        assert stats.nan + stats.posinf + stats.neginf == 1


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [None, BLOCK + 3, 5])
def test_every_tail_length_at_random_offsets(byte_backend, dtype, chunk):
    rng = np.random.default_rng(131)
    finite = finite_patterns(dtype)
    buffer = background(dtype, 8 * BLOCK, rng)
    buffer[rng.integers(0, buffer.size, 64)] = rng.choice(finite, 64)  # every finite kind, subnormals included
    whole = BitTables.tensor(buffer, dtype)
    tensors = {}
    for length in range(131):
        for base in (0, 2 * BLOCK):
            offset = int(rng.integers(0, whole.numel() - base - length))
            tensors[f"{base + length} at {offset}"] = whole[offset:offset + base + length]
    # One NaN (or inf) and the format's largest value in a short and a long tensor: the per-pattern path, cut short.
    special = torch.tensor([np.nan], dtype=torch.float64).to(dtype)
    tensors["special in a tail"] = torch.cat([whole[1:100], special, whole[200:230]])
    tensors["special in a second block"] = torch.cat([whole[3:BLOCK + 90], special, whole[:77]])
    report = scan_both(tensors, backend_for(byte_backend, chunk), f"{byte_backend}, chunks of {chunk}")
    assert report["special in a tail"].nan == 1 and report["special in a second block"].nan == 1


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_one_field_fills_the_counters(byte_backend, dtype):
    """Over 64 blocks of one pattern in one chunk: every byte and 16-bit field counter as full as it gets, and the
    squares' int32 lanes summed over kWordBlocks blocks (an int32 sum of those lanes had lost 42% of the largest
    pattern's sum of squares)."""
    finite = finite_patterns(dtype)
    largest = int(finite[finite < 0x80].max())
    n = 100 * BLOCK + 11
    tensors = {"largest": BitTables.tensor(np.full(n, largest, np.uint8), dtype),
               "negative largest": BitTables.tensor(np.full(n, largest | 0x80, np.uint8), dtype),
               "zeros": BitTables.tensor(np.zeros(n, np.uint8), dtype)}
    report = scan_both(tensors, backend_for(byte_backend, 1 << 22), byte_backend)
    top = L.HIST_BINS - 1 - int(np.argmax(report["largest"].exp_hist[::-1] > 0))
    assert report["largest"].exp_hist[top] == n and report["zeros"].zero == n
    assert report["negative largest"].absmax == float(torch.finfo(dtype).max)


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_records_do_not_depend_on_threads(dtype):
    """The cpu backend's sums of squares included: chunks are merged in order (NOTE: [chunking])."""
    pytest.importorskip("nanscan._C")
    rng = np.random.default_rng(8)
    tensors = {"gauss": BitTables.tensor(background(dtype, 40 * BLOCK + 3, rng), dtype)}
    runs = [nanscan.scan(tensors,
                         backend=nanscan.engine.backends.CpuBackend(chunk_elems=3 * BLOCK, num_threads=n)).records
            for n in (1, 2, 5)]
    for records in runs[1:]:
        assert np.array_equal(records, runs[0])


STEP = 1024  # kByteSteps vectors of 64: the vector path looks for subnormals per step of a block


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [None, 2 * BLOCK + 700, 999])
def test_subnormals_at_step_edges(byte_backend, dtype, chunk):
    """Subnormals of every mantissa, negative ones and +-0 on either side of every step and block edge, in blocks
    of normal values (only some steps of a block hold one), in a block that also holds a NaN or inf (counted per
    pattern, so its subnormals must not be tallied twice) and in the chunk's short last vector."""
    rng = np.random.default_rng(77)
    finite = finite_patterns(dtype)
    normal_floor = 1 << {torch.float8_e4m3fn: 3, torch.float8_e4m3fnuz: 3}.get(dtype, 2)  # smallest normal |x| bits
    subnormals = [m for m in range(1, normal_floor)] + [m | 0x80 for m in range(1, normal_floor)]
    # Normal values only, so each step's subnormals are the planted ones.
    normals = finite[(finite & 0x7F) >= normal_floor]
    n = 4 * BLOCK + 2 * STEP + 45
    base = rng.choice(normals, n).astype(np.uint8)
    tensors = {"normals only": BitTables.tensor(base.copy(), dtype)}
    for edge in range(STEP, n, STEP):
        t = base.copy()
        t[edge - 1] = subnormals[edge % len(subnormals)]
        t[edge] = subnormals[(edge // STEP) % len(subnormals)]
        tensors[f"at edge {edge}"] = BitTables.tensor(t, dtype)
    every = base.copy()
    every[rng.integers(0, n, 200)] = rng.choice(subnormals + [0x00, 0x80 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 0x00], 200)
    every[-1] = subnormals[0]
    tensors["scattered, last element too"] = BitTables.tensor(every, dtype)
    special = int(BitTables.bits_of(torch.tensor([np.nan], dtype=torch.float64).to(dtype))[0])
    with_special = base.copy()
    with_special[BLOCK + 5] = subnormals[-1]
    with_special[BLOCK + STEP + 7] = subnormals[0]
    with_special[2 * BLOCK - 1] = special
    with_special[3 * BLOCK + 3] = subnormals[1 % len(subnormals)]
    tensors["a special block with subnormals"] = BitTables.tensor(with_special, dtype)
    report = scan_both(tensors, backend_for(byte_backend, chunk), f"{byte_backend}, chunks of {chunk}")
    assert report["normals only"].subnormal == 0 and report["a special block with subnormals"].subnormal == 3
    assert report["a special block with subnormals"].nan + report["a special block with subnormals"].posinf == 1


NUMBA_GROUP, NUMBA_BYTE_BLOCK = 960, 3840  # nanscan.engine.backends.numba_blocks.GROUP_ELEMS, numba_bytes._BYTE_BLOCK


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [None, NUMBA_GROUP + 1, NUMBA_BYTE_BLOCK + 7])
def test_numba_byte_blocks(numba_backend, dtype, chunk):
    """The numba byte blocks (NOTE: [numba bytes]): lengths around a residue group and a block, so that blocks end
    inside a group (the rest counted field by field) and fall below one (counted per pattern); blocks of zeros with
    and without subnormals of every leading bit; and every non-finite pattern, and 0x80, planted in a block that is
    otherwise fast."""
    rng = np.random.default_rng(38)
    finite = finite_patterns(dtype)
    subnormals = subnormal_patterns(dtype)
    buffer = background(dtype, 4 * NUMBA_BYTE_BLOCK, rng)
    buffer[rng.integers(0, buffer.size, 48)] = rng.choice(subnormals, 48)
    whole = BitTables.tensor(buffer, dtype)
    tensors = {}
    for length in (NUMBA_GROUP - 1, NUMBA_GROUP, NUMBA_GROUP + 1, 2 * NUMBA_GROUP + 5, NUMBA_BYTE_BLOCK - 1,
                   NUMBA_BYTE_BLOCK, NUMBA_BYTE_BLOCK + 1, NUMBA_BYTE_BLOCK + NUMBA_GROUP + 3, 3 * NUMBA_BYTE_BLOCK):
        offset = int(rng.integers(0, whole.numel() - length))
        tensors[f"{length} at {offset}"] = whole[offset:offset + length]
    zeros = np.zeros(NUMBA_BYTE_BLOCK, np.uint8)
    zeros[1::2] = 0x80 if 0x80 in set(finite.tolist()) else 0
    tensors["zeros"] = BitTables.tensor(zeros, dtype)
    small = zeros.copy()
    small[rng.choice(small.size, 64, replace=False)] = rng.choice(subnormals, 64)
    tensors["zeros and subnormals"] = BitTables.tensor(small, dtype)
    tensors["largest and smallest"] = BitTables.tensor(np.where(rng.random(2 * NUMBA_BYTE_BLOCK) < 0.5,
                                                                finite[finite < 0x80].max(), 1).astype(np.uint8), dtype)
    for bits in [b for b in range(256) if b not in set(finite.tolist())] + [0x80]:
        t = background(dtype, NUMBA_BYTE_BLOCK + NUMBA_GROUP, rng)
        t[rng.integers(0, t.size)] = bits
        tensors[f"pattern {bits:#04x}"] = BitTables.tensor(t, dtype)
    report = scan_both(tensors, backend_for("numba", chunk), f"numba, chunks of {chunk}")
    assert report["zeros and subnormals"].subnormal == 64


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [None, 3 * BLOCK + 5, 2 * STEP + 1])
def test_field_windows(byte_backend, dtype, chunk):
    """The vector path counts 16 field slots of a window that follows a chunk's largest |x| up (NOTE: [byte
    vectors]): blocks that rise by a field or several after a block of zeros (the window moves, maybe more than once
    a chunk, and a block is read again), values far below the window in every field (tallied one by one, in some
    steps only), blocks of every finite pattern, and a rising tensor with a NaN or inf in a block above the window."""
    rng = np.random.default_rng(91)
    finite = finite_patterns(dtype)
    positive = finite[finite < 0x80]
    tensors = {}
    rising = [np.zeros(BLOCK, np.uint8)]
    for k in range(1, 9):  # Gaussian blocks, each 4 times larger than the one before, the last up to the largest
        x = rng.standard_normal(BLOCK)
        x *= float(torch.finfo(dtype).max) * 2.0 ** (2 * k - 16) / np.abs(x).max()
        rising.append(BitTables.bits_of(torch.from_numpy(x).to(dtype)))
    rising = np.concatenate(rising)
    tensors["rising"] = BitTables.tensor(rising, dtype)
    falling = np.concatenate(np.split(rising, 9)[::-1])
    tensors["falling"] = BitTables.tensor(falling, dtype)
    # Subnormals under every window the chunk moves through: what field 0 adds to a window's squares is taken back
    # out when that window closes (NOTE: [field 0 squares]).
    subnormals = subnormal_patterns(dtype)
    with_subnormals = rising.copy()
    for block in range(9):
        spots = block * BLOCK + rng.choice(BLOCK, 10, replace=False)
        with_subnormals[spots] = rng.choice(subnormals, 10)
    tensors["rising, subnormals in every block"] = BitTables.tensor(with_subnormals, dtype)
    low = background(dtype, 5 * BLOCK + 77, rng)
    low[rng.integers(0, low.size, 40)] = rng.choice(positive[positive < 0x30], 40)  # fields far below the top
    low[BLOCK + STEP + 3] = 1
    tensors["far below the window"] = BitTables.tensor(low, dtype)
    tensors["every finite pattern"] = BitTables.tensor(rng.choice(finite, 3 * BLOCK + 9).astype(np.uint8), dtype)
    one_each = np.tile(finite, 4 * BLOCK // finite.size + 1)
    tensors["every finite pattern in order"] = BitTables.tensor(one_each, dtype)
    special = int(BitTables.bits_of(torch.tensor([np.nan], dtype=torch.float64).to(dtype))[0])
    with_special = rising.copy()
    with_special[5 * BLOCK + 17] = special
    tensors["rising, a special block above the window"] = BitTables.tensor(with_special, dtype)
    report = scan_both(tensors, backend_for(byte_backend, chunk), f"{byte_backend}, chunks of {chunk}")
    assert report["rising, a special block above the window"].nan + report[
        "rising, a special block above the window"].posinf == 1
    planted = np.isin(with_subnormals, subnormals)
    assert report["rising, subnormals in every block"].subnormal == planted.sum() > np.isin(rising, subnormals).sum()
