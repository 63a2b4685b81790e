"""The scan fingerprint (NOTE: [scan fingerprint] in csrc/include/nanscan/stats_record.h): the reference states it,
its properties hold (every single bit flip and every swap of unequal elements changes it, within the bounds the
NOTE proves, and no further), every backend gives the reference's bits whatever the chunks, threads and blocks,
reports carry it, and nanscan.compare_state_dicts names what differs between two state dicts."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

import nanscan
from conftest import FLOAT8_DTYPES, BitTables
from nanscan.engine import _layout as L
from nanscan.engine import backends
from nanscan.engine.backends.reference import fingerprint, scan_one
from nanscan.engine.fingerprint import BITS, DTYPE, MISSING_IN_A, MISSING_IN_B, SHAPE, VALUE
from nanscan.engine.inputs import prepare_all

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, *FLOAT8_DTYPES]
MASK64 = (1 << 64) - 1


def definition(bits) -> int:
    """The fingerprint in Python integers, term by term: sum of mix(u_i) * (2 i + 1) mod 2**64."""
    total = 0
    for i, u in enumerate(int(b) for b in bits):
        total += (u ^ (u >> 32)) * (2 * i + 1)
    return total & MASK64


def random_bits(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    """n uniformly random bit patterns of the format: NaNs, infinities, subnormals and zeros among them."""
    width = BitTables.FIELDS[dtype][0] + BitTables.FIELDS[dtype][1] + 1
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << width, size=n, dtype=np.uint64).astype(BitTables._INT_TYPES[dtype][0])


def record_fingerprints(records: np.ndarray) -> list[int]:
    return [int(f) for f in L.fingerprints(records)]


# -- the definition -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_the_reference_states_the_definition(dtype):
    bits = random_bits(dtype, 333, seed=1)
    assert fingerprint(bits) == definition(bits)
    record = scan_one(BitTables.tensor(bits, dtype), L.DTYPE_CODES[str(dtype).removeprefix("torch.")])
    assert int(record[L.REC_FINGERPRINT:L.REC_FINGERPRINT + 1].view(np.uint64)[0]) == definition(bits)
    assert fingerprint(bits[:0]) == 0


def test_a_float64_term_mixes_the_high_half_into_the_low():
    # mix(u) = u ^ (u >> 32): x and -x differ in the sign bit alone, their mixes in bit 31 too.
    one, minus_one = 0x3FF0000000000000, 0xBFF0000000000000
    assert fingerprint(np.array([one], np.uint64)) == one ^ (one >> 32)
    assert fingerprint(np.array([minus_one], np.uint64)) == minus_one ^ (minus_one >> 32)
    assert fingerprint(np.array([0, one], np.uint64)) == 3 * (one ^ (one >> 32))


# -- the properties: every bit flip, every swap -------------------------------------------------------------------

def small_tensor_bits(dtype: torch.dtype) -> np.ndarray:
    """Distinct patterns: the special values of the format (both zeros, subnormals, infinities, NaN payloads, for
    float8 every pattern) and random ones."""
    if dtype.itemsize == 1:
        return np.arange(256, dtype=np.uint8)
    table = BitTables.special(dtype)
    unsigned = BitTables._INT_TYPES[dtype][0]
    specials = np.array(sorted(set(table.values())), dtype=unsigned)
    extra = np.setdiff1d(random_bits(dtype, 200, seed=2), specials)[:96]
    return np.concatenate([specials, extra])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_single_bit_flip_of_every_element_changes_it(dtype):
    bits = small_tensor_bits(dtype)[:40].astype(np.uint64)
    width = 8 * dtype.itemsize
    original = fingerprint(bits)
    flipped = np.repeat(bits[None, :], len(bits) * width, axis=0)
    rows = np.arange(len(flipped))
    flipped[rows, rows // width] ^= np.uint64(1) << (rows % width).astype(np.uint64)
    changed = [fingerprint(row) for row in flipped]
    assert original not in changed
    # Each term is injective in its element's bits, so two flips of one element never meet either.
    for element in range(len(bits)):
        assert len(set(changed[element * width:(element + 1) * width])) == width


def swapped_fingerprints(bits: np.ndarray) -> tuple[int, np.ndarray, list[tuple[int, int]]]:
    """The fingerprint of `bits` and of every copy with two unequal elements swapped, each taken whole by the
    reference (in batches of rows)."""
    bits = bits.astype(np.uint64)
    pairs = [(i, j) for i, j in itertools.combinations(range(len(bits)), 2) if bits[i] != bits[j]]
    out = np.empty(len(pairs), dtype=np.uint64)
    odd = np.arange(len(bits), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    for start in range(0, len(pairs), 4096):
        batch = np.array(pairs[start:start + 4096])
        rows = np.repeat(bits[None, :], len(batch), axis=0)
        r = np.arange(len(batch))
        rows[r, batch[:, 0]], rows[r, batch[:, 1]] = bits[batch[:, 1]], bits[batch[:, 0]]
        mixed = rows ^ (rows >> np.uint64(32))
        out[start:start + len(batch)] = np.sum(mixed * odd, axis=1, dtype=np.uint64)
    return fingerprint(bits), out, pairs


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_swap_of_two_unequal_elements_changes_it(dtype):
    """All pairs of a tensor of distinct patterns: every float8 pattern (32640 swaps), the special values and random
    patterns of the wider formats; for float64, values with their negations and one-bit neighbours too."""
    bits = small_tensor_bits(dtype)
    if dtype == torch.float64:
        sign = np.uint64(1) << np.uint64(63)
        bits = np.concatenate([bits[:40], bits[:40] ^ sign, bits[:40] ^ np.uint64(1 << 40)])
    original, swapped, pairs = swapped_fingerprints(bits)
    assert len(pairs) >= 3000
    assert not (swapped == np.uint64(original)).any(), [pairs[k] for k in np.flatnonzero(swapped == original)[:5]]


def swap_change(a: int, b: int, i: int, j: int) -> int:
    """What swapping a (at i) and b (at j) adds to the fingerprint, from the definition's two terms each side."""
    def mix(u):
        return u ^ (u >> 32)
    return (mix(b) * (2 * i + 1) + mix(a) * (2 * j + 1) - mix(a) * (2 * i + 1) - mix(b) * (2 * j + 1)) & MASK64


@pytest.mark.parametrize("width", [8, 16, 32])
def test_swaps_are_seen_up_to_the_proved_distance_and_no_further(width):
    """NOTE: [scan fingerprint]: a w-bit format sees every swap in tensors of fewer than 2**(64 - w) elements. The
    hardest pairs differ by 2**(w - 1) (the sign bit alone): seen at every distance below 2**(64 - w), missed at
    that distance. Any other difference is seen further."""
    a, b = 0, 1 << (width - 1)
    for distance in [1, 2, 3, 2 ** (63 - width) - 1, 2 ** (63 - width), 2 ** (64 - width) - 1]:
        assert swap_change(a, b, 7, 7 + distance) != 0, distance
    assert swap_change(a, b, 7, 7 + 2 ** (64 - width)) == 0
    assert swap_change(3, 4, 0, 2 ** (64 - width)) != 0  # an odd difference: seen at any distance below 2**63


def test_float64_swaps_are_seen_unless_the_bits_differ_alike_in_both_halves():
    """For float64 the NOTE's bound holds for every pair whose bits do not differ alike in both halves; a value and
    its negation among them. Where they do (a ^ b = d * (2**32 + 1)), the proof gives less, and no sum of one term
    per 64-bit element can see every swap (the NOTE's argument): here is a pair whose swap no distance shows."""
    x = 0x400921FB54442D18  # pi
    for b in [x ^ (1 << 63), x ^ 1, x ^ (1 << 52), x ^ (1 << 31), 0]:
        for distance in [1, 2, 2 ** 20, 2 ** 31, 2 ** 32 - 1]:
            assert swap_change(x, b, 5, 5 + distance) != 0, (hex(b), distance)
    a, b = 0, (1 << 63) | (1 << 31)  # a ^ b has equal halves: mix(b) - mix(a) = 2**63
    assert all(swap_change(a, b, 0, d) == 0 for d in (1, 2, 3, 1000))
    assert fingerprint(np.array([a, b, 7], np.uint64)) == fingerprint(np.array([b, a, 7], np.uint64))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_equal_tensors_give_equal_fingerprints_wherever_they_are(dtype):
    bits = random_bits(dtype, 5000, seed=3)
    t = BitTables.tensor(bits, dtype)
    copy = t.clone()
    inside = torch.cat([BitTables.tensor(random_bits(dtype, 3, seed=4), dtype), t])[3:]  # another offset in memory
    report = nanscan.scan({"t": t, "copy": copy, "inside": inside, "changed": t.roll(1)})
    fingerprints = report.fingerprints
    assert fingerprints["t"] == fingerprints["copy"] == fingerprints["inside"] == definition(bits)
    assert fingerprints["changed"] != fingerprints["t"]


# -- every backend gives the reference's bits ---------------------------------------------------------------------

def pattern_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every pattern (16-bit and float8), the special values, random bits in lengths around chunks, blocks and
    vectors, and a tail that starts off a vector boundary."""
    tensors = {}
    if dtype.itemsize <= 2:
        tensors["every pattern"] = BitTables.all_patterns(dtype)
        tensors["every pattern, reversed"] = BitTables.tensor(BitTables.bits_of(BitTables.all_patterns(dtype))[::-1],
                                                              dtype)
    table = BitTables.special(dtype)
    tensors["specials"] = BitTables.tensor(list(table.values()), dtype)
    for n in [1, 3, 63, 64, 65, 255, 257, 1921, 4095, 4097, 65_535, 65_536, 65_537, 131_075]:
        tensors[f"random {n}"] = BitTables.tensor(random_bits(dtype, n, seed=n), dtype)
    gaussian = (torch.randn(70_001, generator=torch.Generator().manual_seed(9)) * 0.02).to(dtype)
    tensors["gaussian"] = gaussian
    tensors["gaussian from element 5"] = gaussian[5:]
    return tensors


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_backends_give_the_reference_fingerprint(backend_under_test, dtype, tiny_chunks_or_not):
    tensors = {name: t.to(backend_under_test.device) for name, t in pattern_tensors(dtype).items()}
    if tiny_chunks_or_not:  # every tensor split into chunks of a few elements: the 131k ones are slow there
        tensors = {name: t for name, t in tensors.items() if t.numel() < 70_000}
    report = backend_under_test.check(tensors, tiny_chunks=tiny_chunks_or_not)  # whole records, == each
    for name, t in tensors.items():
        assert report.fingerprints[name] == definition(BitTables.bits_of(t)), name


@pytest.fixture(params=[False, True], ids=["default-chunks", "tiny-chunks"])
def tiny_chunks_or_not(request) -> bool:
    return request.param


def mixed_set() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    out = {}
    for dtype in ALL_DTYPES:
        for n in (5, 300, 66_001):
            t = (torch.randn(n, generator=gen) * 3).to(dtype)
            out[f"{dtype} {n}"] = t
    out["nan payloads"] = BitTables.tensor([0x7FC00001, 0xFFC00002, 0x7F800003, 0x7F800000] * 1000, torch.float32)
    return out


def test_the_fingerprint_does_not_depend_on_chunks_threads_or_blocks():
    tensors = mixed_set()
    inputs, _ = prepare_all(tensors)
    want = [definition(BitTables.bits_of(t)) for t in tensors.values()]
    runs = {}
    try:
        for chunk, threads in itertools.product([1, 7, 1000, 4099, L.DEFAULT_CHUNK_ELEMS, 1 << 20], [1, 2]):
            runs[f"cpu {chunk} {threads}"] = backends.CpuBackend(chunk_elems=chunk, num_threads=threads)
    except backends.BackendUnavailable:
        pass
    from nanscan.engine.backends.numba_cpu import NumbaBackend

    for chunk in (5, 1920, L.DEFAULT_CHUNK_ELEMS):
        runs[f"numba {chunk}"] = NumbaBackend(chunk_elems=chunk)
    for name, backend in runs.items():
        assert record_fingerprints(backend.scan_records(inputs)) == want, name
    from nanscan.engine.backends import cuda as cuda_backend

    try:
        for blocks in (1, 7, 64):
            got = cuda_backend.scan_records_on_host(inputs, max_blocks=blocks, min_block_bytes=512)
            assert record_fingerprints(got) == want, f"the CUDA kernel's code on the host, {blocks} blocks"
    except RuntimeError as exc:  # built without nvcc: the kernel's host twin is not there
        assert "without its CUDA part" in str(exc)


def test_views_are_fingerprinted_in_the_order_the_scan_reads_them():
    """NOTE: [flat views]: a dense view with permuted strides is read in memory order (its fingerprint is its
    storage's), a view with gaps as its row-major copy, a complex tensor as its real and imaginary parts."""
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(12))
    z = torch.randn(100, dtype=torch.complex64)
    report = nanscan.scan({"t": t, "t.T": t.T, "t.T copy": t.T.contiguous(), "gapped": t[:, ::3],
                           "gapped copy": t[:, ::3].contiguous(), "z": z, "z parts": torch.view_as_real(z)})
    f = report.fingerprints
    assert f["t.T"] == f["t"] != f["t.T copy"]
    assert f["gapped"] == f["gapped copy"] == definition(BitTables.bits_of(t[:, ::3].contiguous().reshape(-1)))
    assert f["z"] == f["z parts"]


# -- reports ------------------------------------------------------------------------------------------------------

def test_scan_reports_carry_the_fingerprint():
    w = torch.randn(300, 7)
    report = nanscan.scan({"w": w, "ids": torch.arange(5)})
    stats = report["w"]
    assert isinstance(stats.fingerprint, int) and 0 <= stats.fingerprint < 2 ** 64
    assert stats.fingerprint == definition(BitTables.bits_of(w.reshape(-1))) == report.fingerprints["w"]
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["tensors"][0]["fingerprint"] == stats.fingerprint
    assert "ids" in report.skipped and "ids" not in report.fingerprints
    assert report.fingerprints == {"w": stats.fingerprint}


# -- compare_state_dicts ------------------------------------------------------------------------------------------

def trained_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(32, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_checkpoint_written_and_read_back_compares_equal(tmp_path):
    model, opt = trained_state()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    result = nanscan.compare_state_dicts({"model": model.state_dict(), "optimizer": opt.state_dict()}, loaded)
    assert result.equal and bool(result) and result.first_difference is None
    assert result.compared >= 20  # weights, BatchNorm's buffers (an int64 counter among them), Adam's moments, lr
    assert str(result).startswith("equal")


def test_one_flipped_mantissa_bit_is_named():
    model, _ = trained_state()
    a = model.state_dict()
    b = {name: t.clone() for name, t in a.items()}
    bits = b["3.weight"].view(torch.int32)
    bits.view(-1)[17] ^= 1 << 3  # a mantissa bit: the value stays finite and close
    result = nanscan.compare_state_dicts(a, b)
    assert not result.equal
    first = result.first_difference
    assert (first.name, first.what, first.finite_in_both) == ("3.weight", BITS, True)
    assert [d.name for d in result.differences] == ["3.weight"]
    assert first.a.fingerprint != first.b.fingerprint and first.a.ok and first.b.ok
    assert "3.weight" in str(result) and "finite in both" in str(result)
    # A tensor on one side, a copy whose strides are permuted on the other: the same tensor.
    assert nanscan.compare_state_dicts({"w": a["0.weight"].T}, {"w": a["0.weight"].T.contiguous()}).equal


def test_missing_keys_dtypes_shapes_values_and_non_finite_differences_are_named_in_order():
    a = {"x": torch.ones(3), "gone": torch.zeros(2), "y": torch.ones(4), "z": torch.ones(2, 3), "n": torch.ones(3),
         "steps": torch.tensor(5), "lr": 0.1}
    b = {"x": torch.ones(3), "y": torch.ones(4, dtype=torch.float64), "z": torch.ones(3, 2),
         "n": torch.tensor([1.0, float("nan"), 1.0]), "steps": torch.tensor(6), "lr": 0.2, "new": torch.ones(1)}
    result = nanscan.compare_state_dicts(a, b)
    assert [(d.name, d.what) for d in result.differences] == [
        ("gone", MISSING_IN_B), ("y", DTYPE), ("z", SHAPE), ("n", BITS), ("steps", BITS), ("lr", VALUE),
        ("new", MISSING_IN_A)]
    assert result.first_difference.name == "gone"
    assert result.missing_in_a == ["new"] and result.missing_in_b == ["gone"]
    n = result.differences[3]
    assert n.finite_in_both is False and n.b.nan == 1
    assert result.differences[4].finite_in_both is None  # an integer tensor: compared by value
