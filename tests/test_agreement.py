"""Every scanning backend (cpu, numba, cuda) against the reference backend, record by record, and the decoded
TensorStats of each against numpy's own reading of the values.

Counts, abs min/max bit patterns and histogram bins must be equal (`==`); the float64 sum of squares within
SUMSQ_REL_TOL (conftest.py says why). Each case also runs with chunks of a few elements, so that every tensor is
split across chunks and the merge of partial records is checked too.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nanscan
from conftest import FLOAT8_DTYPES, SUMSQ_REL_TOL, assert_records_match
from nanscan.engine import _layout as L
from nanscan.engine import backends

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMBA_BLOCK = 1920  # nanscan.engine.backends.numba_cpu._BLOCK_ELEMS: the segments below line up with its blocks


@pytest.fixture(params=[False, True], ids=["default-chunks", "tiny-chunks"])
def tiny_chunks(request) -> bool:
    return request.param


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in tensors.items()}


# -- exhaustive and tabulated bit patterns ------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["in-order", "shuffled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_as_one_tensor(backend_under_test, dtype, order, tiny_chunks, bit_tables):
    t = bit_tables.all_patterns(dtype)
    if order == "shuffled":
        t = t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(5))]
    report = backend_under_test.check({"patterns": t.to(backend_under_test.device)}, tiny_chunks=tiny_chunks)
    stats = report["patterns"]
    _, mant_bits = bit_tables.FIELDS[dtype]
    assert (stats.nan, stats.posinf, stats.neginf, stats.zero) == (2 * ((1 << mant_bits) - 1), 1, 1, 2)
    assert stats.subnormal == 2 * ((1 << mant_bits) - 1)
    assert stats.absmax == torch.finfo(dtype).max
    assert stats.absmin == torch.finfo(dtype).smallest_normal * 2.0 ** -mant_bits


# What the 256 patterns of each float8 format hold (NOTE: [float8 specials] in classify.h): (NaN, +inf, -inf, zeros,
# subnormals).
FLOAT8_CLASS_COUNTS = {
    torch.float8_e4m3fn: (2, 0, 0, 2, 14),  # NaN only at S.1111.111; no infinity
    torch.float8_e5m2: (6, 1, 1, 2, 6),  # IEEE-like
    torch.float8_e4m3fnuz: (1, 0, 0, 1, 14),  # the one NaN is 0x80, the pattern of -0: no -0
    torch.float8_e5m2fnuz: (1, 0, 0, 1, 6),
}


@pytest.mark.parametrize("order", ["in-order", "shuffled"])
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_every_float8_pattern_in_tensors_of_several_lengths(backend_under_test, dtype, order, tiny_chunks,
                                                            bit_tables):
    patterns = bit_tables.all_patterns(dtype)
    gen = torch.Generator().manual_seed(6)
    # Lengths around the C++ kernel's switch to four pattern tables (4096) and with a ragged end, one element of
    # each pattern alone, and every pattern once.
    lengths = [1, 2, 7, 255, 256, 257, 1000, 4095, 4096, 4103] + ([] if tiny_chunks else [65_537, 200_003])
    tensors = {}
    for length in lengths:
        t = patterns.repeat(-(-length // 256))[:length]
        if order == "shuffled":
            t = t[torch.randperm(length, generator=gen)]
        tensors[f"{length} elements"] = t
    tensors.update({f"pattern {bits:#04x}": patterns[bits:bits + 1] for bits in range(256)})
    report = backend_under_test.check(to_device(tensors, backend_under_test.device), tiny_chunks=tiny_chunks)
    stats = report["256 elements"]
    assert (stats.nan, stats.posinf, stats.neginf, stats.zero, stats.subnormal) == FLOAT8_CLASS_COUNTS[dtype]
    finfo = torch.finfo(dtype)
    assert stats.absmax == finfo.max
    assert stats.absmin == finfo.smallest_normal * 2.0 ** -bit_tables.FIELDS[dtype][1]
    assert sum(report[f"pattern {bits:#04x}"].nan for bits in range(256)) == FLOAT8_CLASS_COUNTS[dtype][0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(backend_under_test, dtype, tiny_chunks, bit_tables):
    table = bit_tables.special(dtype)
    # One tensor per value, so a disagreement names the value; then the whole table and the powers of two.
    tensors = {label: bit_tables.tensor([bits], dtype) for label, bits in table.items()}
    tensors["whole table"] = bit_tables.tensor(list(table.values()), dtype)
    tensors["powers of two and neighbours"] = bit_tables.tensor(bit_tables.powers_of_two(dtype), dtype)
    report = backend_under_test.check(to_device(tensors, backend_under_test.device), tiny_chunks=tiny_chunks)
    assert report["+quiet NaN"].nan == 1 and report["-signalling NaN with payload 1"].nan == 1
    assert report["-inf"].neginf == 1 and report["-0"].zero == 1
    assert report["+largest subnormal"].subnormal == 1
    assert report["+quiet NaN"].absmax == 0.0  # nothing finite in it


def planted(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random normals, the first half within a few binades and the second over dozens, with one of each kind of
    special value planted at a random position (most blocks of a blocked kernel stay free of them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x[n // 2:] *= 2.0 ** torch.randint(-20, 12, (n - n // 2,), generator=gen)
    x = x.to(dtype)
    finfo = torch.finfo(dtype)
    specials = [0.0, -0.0, finfo.tiny / 2, -finfo.tiny / 4, finfo.tiny, finfo.max, -finfo.max,
                float("inf"), float("-inf"), float("nan")]
    positions = torch.randint(0, n, (len(specials),), generator=gen)
    for value, pos in zip(specials, positions.tolist()):
        x[pos] = value
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_data_with_planted_specials(backend_under_test, dtype, tiny_chunks):
    n = 5_000 if tiny_chunks else 100_003
    report = backend_under_test.check({"x": planted(dtype, n, seed=1).to(backend_under_test.device)},
                                      tiny_chunks=tiny_chunks)
    assert report["x"].nan >= 1 and report["x"].subnormal >= 1


def block_segments(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Block-sized segments that each take a different way through a blocked kernel: plain normals, normals with
    zeros, all zeros, more binades than a pair window holds, values far above the window the first block placed,
    one subnormal, one NaN, one infinity, negatives only; and an odd-sized last block ending in a zero."""
    gen = torch.Generator().manual_seed(9)
    finfo = torch.finfo(dtype)
    lo_exp, hi_exp = int(np.log2(finfo.tiny)), int(np.log2(finfo.max))

    def normals(scale=1.0):
        return torch.randn(NUMBA_BLOCK, generator=gen, dtype=torch.float64) * scale

    def wide():
        exps = torch.randint(max(lo_exp, -120), min(hi_exp, 120), (NUMBA_BLOCK,), generator=gen)
        return (1 + torch.rand(NUMBA_BLOCK, generator=gen, dtype=torch.float64)) * 2.0 ** exps

    def with_value(value, where=777):
        x = normals()
        x[where] = value
        return x

    with_zeros = normals()
    with_zeros[::3] = 0.0
    segments = {
        "normals": normals(),
        "normals with zeros": with_zeros,
        "zeros": torch.zeros(NUMBA_BLOCK, dtype=torch.float64),
        "wide": wide(),
        "far above": normals(2.0 ** (hi_exp - 3)),
        "far below": normals(2.0 ** (lo_exp + 8)),
        "one subnormal": with_value(finfo.tiny / 2),
        "one nan": with_value(float("nan")),
        "one inf": with_value(float("-inf")),
        "negatives": -normals().abs(),
        "odd tail ending in zero": torch.cat([normals(), normals()[:1001]]),
    }
    segments["odd tail ending in zero"][-1] = 0.0
    return {name: x.to(dtype) for name, x in segments.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_segments_each_and_concatenated(backend_under_test, dtype, tiny_chunks):
    segments = block_segments(dtype)
    tensors = dict(segments)
    tensors["all in a row"] = torch.cat(list(segments.values()))
    tensors["all in a row, reversed"] = torch.cat(list(segments.values())[::-1])
    tensors["zeros first"] = torch.cat([segments["zeros"], segments["normals with zeros"], segments["normals"]])
    if tiny_chunks:
        tensors = {name: t[:300] for name, t in tensors.items()}
    backend_under_test.check(to_device(tensors, backend_under_test.device), tiny_chunks=tiny_chunks)


# -- decoded statistics against numpy --------------------------------------------------------------------------------

def numpy_values(t: torch.Tensor) -> np.ndarray:
    """The tensor's values in a numpy float type that holds them exactly (bfloat16, which numpy lacks, as float32
    made from its bits), read without torch."""
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return t.numpy()


def assert_stats_match_numpy(stats: nanscan.TensorStats, t: torch.Tensor) -> None:
    """Every TensorStats field as numpy computes it: isnan/isinf, comparisons with the format's smallest normal,
    frexp for the binade, math.fsum (correctly rounded) for the sum of squares."""
    x = numpy_values(t).ravel()
    finite = x[np.isfinite(x)]
    a = np.abs(finite)
    nonzero = a[a != 0]
    _, exponent = np.frexp(nonzero)  # |x| = m * 2**e, m in [0.5, 1): floor(log2|x|) = e - 1
    binade = np.clip(exponent.astype(np.int64) - 1, L.MIN_BIN_EXPONENT, L.MAX_BIN_EXPONENT)
    with np.errstate(over="ignore"):  # float64 values above 2**512: their squares are inf, as in the scan
        squares = a.astype(np.float64) ** 2
    try:
        sumsq = math.fsum(squares)
    except OverflowError:  # the exact sum lies beyond float64's range (a float64 tensor, see TensorStats)
        sumsq = math.inf
    want = {
        "numel": x.size, "nan": int(np.isnan(x).sum()), "posinf": int(np.isposinf(x).sum()),
        "neginf": int(np.isneginf(x).sum()), "zero": int((x == 0).sum()),
        "subnormal": int((nonzero < torch.finfo(t.dtype).smallest_normal).sum()),
        "finite": finite.size, "nonfinite": x.size - finite.size, "ok": finite.size == x.size,
        "absmax": float(a.max()) if a.size else 0.0, "absmin": float(nonzero.min()) if nonzero.size else 0.0,
        "exp_hist": np.bincount(binade - L.MIN_BIN_EXPONENT, minlength=L.HIST_BINS).tolist(),
    }
    got = {key: getattr(stats, key) for key in want}
    got["exp_hist"] = stats.exp_hist.tolist()
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k] and k != "exp_hist"} or "exp_hist"
    assert stats.exp_hist.dtype == np.int64 and stats.exp_hist.shape == (L.HIST_BINS,)
    assert math.isclose(stats.sumsq, sumsq, rel_tol=SUMSQ_REL_TOL) or stats.sumsq == sumsq == math.inf, (
        f"sumsq {stats.sumsq!r}, numpy {sumsq!r}")
    assert stats.norm == math.sqrt(stats.sumsq)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_against_numpy(backend_under_test, dtype, bit_tables):
    t = bit_tables.all_patterns(dtype)
    report = backend_under_test.check({"patterns": t.to(backend_under_test.device)})
    assert_stats_match_numpy(report["patterns"], t)


def adversarial_sets(dtype: torch.dtype, bit_tables) -> dict[str, torch.Tensor]:
    """NaN payloads of both signs beside the largest finite values (an absmax taken on raw bits without excluding
    NaN would pick the NaN), -0.0 alone, subnormals alone, the extremes of the range, and for float64 sums of
    squares that leave float64's range or whose squares vanish."""
    table = bit_tables.special(dtype)
    finfo = torch.finfo(dtype)
    nans = [bits for label, bits in table.items() if "NaN" in label]
    sets = {
        "NaN payloads and the largest finite": bit_tables.tensor(nans + [table["+largest normal"],
                                                                         table["-largest subnormal"]], dtype),
        "NaN payloads only": bit_tables.tensor(nans, dtype),
        "-0.0 only": torch.tensor([-0.0, -0.0], dtype=dtype),
        "+-0.0 and infinities": bit_tables.tensor([table["+0"], table["-0"], table["+inf"], table["-inf"]], dtype),
        "subnormals only": bit_tables.tensor([table["+smallest subnormal"], table["-middle subnormal"],
                                              table["+largest subnormal"]], dtype),
        "every special value": bit_tables.tensor(list(table.values()), dtype),
        "largest finite, repeated": torch.full((1000,), -finfo.max, dtype=dtype),
    }
    if dtype == torch.float64:
        sets["squares finite, their sum not"] = torch.tensor([1e154, -1e154, 3.0], dtype=dtype)
        sets["squares overflow"] = torch.tensor([2.0 ** 600, 1.0], dtype=dtype)
        sets["squares subnormal or vanishing"] = torch.tensor([1e-160, 1e-200, -2.0 ** -1074], dtype=dtype)
    return sets


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adversarial_sets_against_numpy(backend_under_test, dtype, bit_tables):
    sets = adversarial_sets(dtype, bit_tables)
    report = backend_under_test.check(to_device(sets, backend_under_test.device))
    for name, t in sets.items():
        assert_stats_match_numpy(report[name], t)
    assert report["NaN payloads and the largest finite"].absmax == torch.finfo(dtype).max
    assert report["NaN payloads only"].absmax == 0.0 and report["NaN payloads only"].sumsq == 0.0
    assert (report["-0.0 only"].zero, report["-0.0 only"].absmin, report["-0.0 only"].absmax) == (2, 0.0, 0.0)
    if dtype == torch.float64:
        # Documented in TensorStats: every value finite, yet the float64 sum of squares (and the norm) is inf.
        overflowed = report["squares finite, their sum not"]
        assert overflowed.ok and overflowed.sumsq == math.inf and overflowed.norm == math.inf
        assert report["squares subnormal or vanishing"].sumsq == 1e-160 ** 2


# -- many tensors, odd shapes, odd layouts --------------------------------------------------------------------------

def test_many_tensors_of_mixed_dtypes_in_one_call(backend_under_test, tiny_chunks):
    gen = torch.Generator().manual_seed(3)
    sizes = [0, 1, 2, 3, 5, 8, 17, 100, 1000, 2047, 2049, 4097] + ([] if tiny_chunks else [65_537, 100_000])
    tensors = {}
    for i, size in enumerate(sizes * 2):
        dtype = DTYPES[i % len(DTYPES)]
        t = torch.randn(size, generator=gen) * 10.0 ** (i % 9 - 4)
        if size > 10 and i % 3 == 0:
            t[size // 2] = float("nan")
        if size > 10 and i % 4 == 1:
            t[size // 3] = 0.0
        tensors[f"t{i}:{dtype}[{size}]"] = t.to(dtype)
    report = backend_under_test.check(to_device(tensors, backend_under_test.device), tiny_chunks=tiny_chunks)
    assert len(report) == len(tensors)


def test_empty_and_zero_dim_tensors(backend_under_test, tiny_chunks):
    tensors = {
        "empty": torch.empty(0),
        "empty 2-d": torch.empty(3, 0, dtype=torch.float64),
        "0-d": torch.tensor(-2.5),
        "0-d nan": torch.tensor(float("nan"), dtype=torch.float16),
        "0-d zero": torch.tensor(0.0, dtype=torch.bfloat16),
    }
    report = backend_under_test.check(to_device(tensors, backend_under_test.device), tiny_chunks=tiny_chunks)
    assert report["empty"].numel == 0 and report["empty"].absmin == 0.0 and report["empty"].sumsq == 0.0
    assert (report["0-d"].numel, report["0-d"].absmax, report["0-d"].absmin) == (1, 2.5, 2.5)
    assert report["0-d nan"].nan == 1 and report["0-d zero"].zero == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_complex_tensors(backend_under_test, dtype, tiny_chunks):
    device = backend_under_test.device
    base = planted(torch.float32, 4 * 6 * 10 * 12, seed=2).to(dtype).to(device)
    image = base.reshape(4, 6, 10, 12)
    matrix = base.reshape(60, 48)
    tensors = {
        "transposed": matrix.t(),
        "channels_last": image.contiguous(memory_format=torch.channels_last),
        "permuted": image.permute(3, 1, 0, 2),
        "sliced with step": matrix[::3, 1::2],
        "expanded": base[:48].reshape(1, 48).expand(5, 48),
        "misaligned slice": base[3:1000],
    }
    if dtype in (torch.float32, torch.float64):
        complex_dtype = torch.complex64 if dtype == torch.float32 else torch.complex128
        tensors["complex"] = torch.complex(base[:500], base[500:1000]).to(complex_dtype)
        tensors["complex transposed"] = tensors["complex"].reshape(20, 25).t()
    report = backend_under_test.check(tensors, tiny_chunks=tiny_chunks)
    if "complex" in tensors:
        assert report["complex"].numel == 1000  # real and imaginary parts
        assert report["complex"].dtype == str(tensors["complex"].dtype).removeprefix("torch.")
    assert report["expanded"].numel == 5 * 48


# -- determinism ----------------------------------------------------------------------------------------------------

def big_mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return {"f32": torch.randn(1_000_003, generator=gen) * 1e3,
            "f64": torch.randn(300_001, generator=gen, dtype=torch.float64) * 1e-3,
            "bf16": torch.randn(200_001, generator=gen).bfloat16()}


def test_cpu_records_are_bit_identical_for_any_thread_count(cpu_backend):
    tensors = big_mixed_tensors()
    one = nanscan.scan(tensors, backend=backends.CpuBackend(num_threads=1)).records
    two = nanscan.scan(tensors, backend=backends.CpuBackend(num_threads=2)).records
    again = nanscan.scan(tensors, backend=backends.CpuBackend(num_threads=2)).records
    np.testing.assert_array_equal(one, two)  # the float64 sum of squares included
    np.testing.assert_array_equal(two, again)


def test_numba_records_are_bit_identical_for_any_thread_count(numba_backend):
    import numba

    from nanscan.engine.backends.numba_cpu import NumbaBackend

    tensors = big_mixed_tensors()
    one = nanscan.scan(tensors, backend=NumbaBackend(num_threads=1)).records
    many = nanscan.scan(tensors, backend=NumbaBackend(num_threads=numba.config.NUMBA_NUM_THREADS)).records
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS  # the last scan ran on every thread
    np.testing.assert_array_equal(one, many)


NUMBA_THREADS_PROBE = """
import sys, torch
torch.set_num_threads(1)
import nanscan
from nanscan.engine.backends.numba_cpu import NumbaBackend
import numba
nanscan.scan([torch.randn(300_000), torch.randn(5000).bfloat16()], backend=NumbaBackend())
print(torch.get_num_threads(), numba.get_num_threads())
"""


def test_numba_scan_runs_on_torchs_threads_and_leaves_their_number(numba_backend):
    """NOTE: [numba threads]: in a fresh process (numba starts its threads once), a scan with torch on one thread
    runs on one, and leaves torch on one, though numba's OpenMP layer sets the count torch shares as it starts."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", NUMBA_THREADS_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"], done.stdout


@settings(max_examples=200, deadline=None)
@given(per_task=st.lists(st.integers(1, 6), min_size=1, max_size=8), threads=st.integers(1, 8), data=st.data())
def test_numba_thread_groups_split_the_chunks_into_balanced_runs(numba_backend, per_task, threads, data):
    """Each thread's run of chunks ends within one chunk of its share of the elements, and a segment (one partial
    record) never spans two tensors or two threads."""
    from nanscan.engine.backends.numba_cpu import thread_groups

    chunk_task = np.repeat(np.arange(len(per_task)), per_task).astype(np.int64)
    chunk_numels = np.array(data.draw(st.lists(st.integers(1, 100), min_size=chunk_task.size,
                                               max_size=chunk_task.size)), dtype=np.int64)
    groups, segments, segment_task = thread_groups(chunk_task, chunk_numels, threads)
    n, total = chunk_task.size, int(chunk_numels.sum())
    assert groups.size == threads + 1 and groups[0] == 0 and groups[-1] == n and (np.diff(groups) >= 0).all()
    starts = np.concatenate(([0], np.cumsum(chunk_numels)))
    for g in range(1, threads):  # the first chunk at or past g / threads of the elements begins group g
        assert starts[groups[g]] * threads >= g * total or groups[g] == n
        assert groups[g] == 0 or starts[groups[g] - 1] * threads < g * total
    np.testing.assert_array_equal(segment_task[segments], chunk_task)
    begins = np.zeros(n, dtype=bool)
    begins[groups[:-1][groups[:-1] < n]] = True
    begins[1:] |= chunk_task[1:] != chunk_task[:-1]
    np.testing.assert_array_equal(segments, np.cumsum(begins) - 1)


CPU_BLOCK_BYTES = 4096  # csrc/cpu/scan_cpu.cpp kBlockBytes: pass 1 reads a chunk in blocks of this many bytes
LOW_TALLY_MAX = 32  # scan_cpu.cpp kMaxTally: more values below the window per block, and pass 2 counts the block


def low_tally_blocks(dtype: torch.dtype, depth: int = 40, scale: float = 1.0) -> torch.Tensor:
    """One chunk of whole kernel blocks (NOTE: [low tally] in csrc/cpu/scan_cpu.cpp): the first spans 2**-13 ..
    2**1, which opens the window at 2**-13 (its largest field less 14), then blocks of the same values, a tenth
    of them zeros, each with k values below the window (k = 1, 2, 31, 32, 33, 100) at fields 1 .. depth below
    it, which fall on every residue mod 16, zeros' residue included; then a block with one below the window and
    one above it."""
    gen = torch.Generator().manual_seed(21)
    per_block = CPU_BLOCK_BYTES // torch.finfo(dtype).bits * 8

    def block() -> torch.Tensor:
        exps = torch.randint(-13, 2, (per_block,), generator=gen)
        exps[:2] = torch.tensor([-13, 1])
        x = (1 + torch.rand(per_block, generator=gen, dtype=torch.float64) / 2) * 2.0 ** exps
        x[::10] = 0.0
        x[1::9] *= -1
        return x

    blocks = [block()]
    for k in (1, 2, LOW_TALLY_MAX - 1, LOW_TALLY_MAX, LOW_TALLY_MAX + 1, 100):
        b = block()
        where = torch.randperm(per_block, generator=gen)[:k]
        b[where] = 1.25 * 2.0 ** (-13 - 1 - torch.arange(k) % depth).to(torch.float64)
        blocks.append(b)
    last = block()
    last[5], last[6] = 2.0 ** -(13 + depth // 2), 2.0 ** 4
    blocks.append(last)
    return (torch.cat(blocks) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16], ids=str)
def test_cpu_low_tally(cpu_backend, dtype):
    # float16's normal values span 30 fields: its chunk is scaled up, its values below the window stay normal
    depth = 8 if dtype == torch.float16 else 40
    tensor = low_tally_blocks(dtype, depth, 2.0 ** 8 if dtype == torch.float16 else 1.0)
    report = cpu_backend.check({"chunk": tensor})
    assert report["chunk"].zero > 0 and report["chunk"].subnormal == 0
    # the window's fields, those tallied below it and the one above it
    assert int((report["chunk"].exp_hist > 0).sum()) == 15 + depth + 1


# nanscan.engine.backends.numba_cpu._GROUP_ELEMS: residue words count whole groups, the rest by tables
NUMBA_GROUP = 960


def residue_window_blocks(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Blocks whose non-zero values span 1, 15, 16, 17, 18, 20, 21, 31, 32 and 33 binades (one residue word names a
    field below 16, two words below 32), starting at each residue of the field mod 16, with a third of them zeros
    (counted on residue 0, then taken out); float16 blocks of subnormals and normals (widened, NOTE: [numba blocks]);
    and lengths around whole groups, so that the elements past the last group go to the tables."""
    gen = torch.Generator().manual_seed(12)
    finfo = torch.finfo(dtype)
    lowest, highest = int(np.log2(finfo.tiny)), int(np.log2(finfo.max))
    tensors = {}
    for span in (1, 15, 16, 17, 18, 20, 21, 31, 32, 33):
        for start in range(lowest + 1, min(lowest + 1 + 16, highest - span), 5):
            exps = torch.randint(0, span, (NUMBA_BLOCK,), generator=gen)
            exps[:2] = torch.tensor([0, span - 1])  # the span is exact
            # Significands in [1, 1.5): rounding to a short mantissa never carries into the next binade.
            x = (1 + torch.rand(NUMBA_BLOCK, generator=gen, dtype=torch.float64) / 2) * 2.0 ** (exps + start)
            x[::3] = 0.0
            x[1::7] *= -1
            tensors[f"span {span} from 2**{start}"] = x
    gauss = torch.randn(3 * NUMBA_BLOCK, generator=gen, dtype=torch.float64)
    if dtype == torch.float16:
        tensors["subnormals and zeros"] = gauss * finfo.tiny / 4
        tensors["subnormals and normals"] = gauss * finfo.tiny * 8
        tensors["smallest subnormal and largest normal"] = torch.where(gauss > 0, finfo.max, finfo.tiny * 2.0 ** -10)
    for length in (NUMBA_GROUP - 1, NUMBA_GROUP, NUMBA_GROUP + 1, NUMBA_BLOCK + NUMBA_GROUP + 7,
                   2 * NUMBA_BLOCK + 1):
        tensors[f"{length} elements"] = gauss[:length] * 0.02
    return {name: x.to(dtype) for name, x in tensors.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numba_residue_windows(numba_backend, dtype):
    from nanscan.engine.backends.numba_cpu import NumbaBackend  # numba is optional: only this test needs the module

    tensors = residue_window_blocks(dtype)
    report = numba_backend.check(tensors)
    if dtype != torch.float64:  # float64's lowest binades all clamp to one bin
        stats = report["span 16 from 2**" + str(int(np.log2(torch.finfo(dtype).tiny)) + 1)]
        assert int((stats.exp_hist > 0).sum()) == 16  # the span the table counted, field for field
    for chunk in (NUMBA_GROUP + 1, NUMBA_BLOCK):  # chunks that end inside a group and on a block
        got = nanscan.scan(tensors, backend=NumbaBackend(chunk_elems=chunk)).records
        want = nanscan.scan(tensors, backend="reference").records
        assert_records_match(got, want, list(tensors), label=f"numba, chunks of {chunk}")


def test_numba_scans_from_several_threads_at_once(numba_backend):
    from concurrent.futures import ThreadPoolExecutor

    tensors = big_mixed_tensors()
    backend = numba_backend.create()
    expected = nanscan.scan(tensors, backend=backend).records
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: nanscan.scan(tensors, backend=backend).records, range(8)))
    for records in results:
        np.testing.assert_array_equal(records, expected)


# -- properties -----------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=0, max_size=5000), st.booleans())
def test_arbitrary_float32_bit_patterns(backend_under_test, bit_tables, patterns, tiny):
    t = bit_tables.tensor(patterns, torch.float32)
    backend_under_test.check({"x": t.to(backend_under_test.device)}, tiny_chunks=tiny)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=32), max_size=64),
       st.integers(0, 3))
def test_arbitrary_float32_values_in_runs(backend_under_test, values, repeat):
    # Runs of repeated values: long stretches of one exponent, the case that stalls table-counting kernels.
    t = torch.tensor(values, dtype=torch.float32).repeat_interleave(1 + 1000 * repeat)
    backend_under_test.check({"x": t.to(backend_under_test.device)})
