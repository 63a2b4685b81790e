"""Many small tensors in one CPU scan: the kernel's short-chunk path (NOTE: [small chunks] in csrc/cpu/scan_cpu.cpp)
and tasks scanned straight into their records, against the reference backend and against the kernel's own block
path.

Every size from 0 to 300 elements and a few around the 4 KiB blocks and the default chunk, in all four formats,
filled with the special bit patterns of conftest.BitTables (signed zeros, subnormals, extreme normals, infinities,
NaNs with payloads) and random bits, all scanned in one call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nanscan
from nanscan.engine import _layout as L
from nanscan.engine import backends
from nanscan import demo as D

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
KINDS = ("finite", "specials", "random bits")
# Around the 4 KiB blocks (512 to 2048 elements, by format) and the default chunk of 65536 elements.
BOUNDARY_SIZES = [511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097,
                  L.DEFAULT_CHUNK_ELEMS - 1, L.DEFAULT_CHUNK_ELEMS, L.DEFAULT_CHUNK_ELEMS + 1]
SIZES = list(range(301)) + BOUNDARY_SIZES
# Longer than any chunk the short-chunk path takes (at most one float64 block: 512 elements), so a tensor padded
# to this length goes through the block path.
BLOCK_PATH_ELEMS = 600
CHUNK_SIZES = [7, 256, 257, 4096, L.DEFAULT_CHUNK_ELEMS]
TINY_CHUNKS_MAX_ELEMS = 100


def is_finite_bits(bits: np.ndarray, dtype: torch.dtype, bit_tables) -> np.ndarray:
    exp_bits, mant_bits = bit_tables.FIELDS[dtype]
    field_max = (1 << exp_bits) - 1
    return (bits >> bits.dtype.type(mant_bits)) & bits.dtype.type(field_max) != field_max


def random_bits(rng: np.random.Generator, n: int, unsigned) -> np.ndarray:
    return np.frombuffer(rng.bytes(n * np.dtype(unsigned).itemsize), dtype=unsigned).copy()


class Patterns:
    """Adversarial bit patterns per format, the tables built once."""

    def __init__(self, bit_tables, rng: np.random.Generator):
        self.bit_tables = bit_tables
        self.rng = rng
        self.pools: dict[tuple[torch.dtype, str], np.ndarray] = {}
        for dtype in DTYPES:
            special = np.array(list(bit_tables.special(dtype).values()), dtype=self.unsigned(dtype))
            finite = special[is_finite_bits(special, dtype, bit_tables)]
            self.pools[dtype, "specials"] = special
            self.pools[dtype, "finite"] = np.concatenate([finite, bit_tables.powers_of_two(dtype)])

    @staticmethod
    def unsigned(dtype: torch.dtype):
        return {2: np.uint16, 4: np.uint32, 8: np.uint64}[torch.finfo(dtype).bits // 8]

    def tensor(self, dtype: torch.dtype, n: int, kind: str) -> torch.Tensor:
        """n elements of `kind`: "finite" (the finite specials, every power of two with its neighbours, and
        random finite bits), "specials" (the whole special table, NaNs and infinities included, and random bits)
        or "random bits"."""
        unsigned = self.unsigned(dtype)
        noise = random_bits(self.rng, n, unsigned)
        if kind == "random bits":
            return self.bit_tables.tensor(noise, dtype)
        if kind == "finite":
            exp_bits, mant_bits = self.bit_tables.FIELDS[dtype]
            top_of_field = unsigned(1 << (exp_bits + mant_bits - 1))
            noise = np.where(is_finite_bits(noise, dtype, self.bit_tables), noise, noise ^ top_of_field)
        picked = self.rng.choice(self.pools[dtype, kind], n)
        return self.bit_tables.tensor(np.where(self.rng.random(n) < 0.5, picked, noise), dtype)


@pytest.fixture(scope="module")
def mixed(bit_tables) -> dict[str, torch.Tensor]:
    patterns = Patterns(bit_tables, np.random.default_rng(7))
    tensors = {f"{kind} {str(dtype).removeprefix('torch.')}[{n}]": patterns.tensor(dtype, n, kind)
               for n in SIZES for dtype in DTYPES for kind in KINDS}
    # The set must hold what it is meant to: finite tensors (every non-empty "finite" one) and non-finite ones.
    finite = [name for name, t in tensors.items() if t.numel() and bool(torch.isfinite(t).all())]
    assert sum(name.startswith("finite") for name in finite) == len(DTYPES) * (len(SIZES) - 1)
    assert sum(not bool(torch.isfinite(t).all()) for t in tensors.values()) > len(SIZES) * len(DTYPES)
    return tensors


@pytest.fixture(scope="module")
def mixed_reference(mixed) -> np.ndarray:
    return nanscan.scan(mixed, backend="reference").records


def test_every_small_size_matches_the_reference(cpu_backend, mixed, mixed_reference, records_match):
    report = nanscan.scan(mixed, backend=backends.CpuBackend())
    assert report.names == list(mixed)
    records_match(report.records, mixed_reference, report.names, label="cpu backend")
    assert report["finite float32[0]"].numel == 0 and report["finite float32[0]"].sumsq == 0.0
    # Zeros and subnormals (the short path's extra pass) turn up in hundreds of the tensors.
    assert (mixed_reference[:, L.REC_ZERO] > 0).sum() > 300 and (mixed_reference[:, L.REC_SUBNORMAL] > 0).sum() > 300


def for_chunks_of(chunk_elems: int, mixed: dict[str, torch.Tensor]) -> list[str]:
    """The names of the mixed set to scan with chunks of chunk_elems: tiny chunks take the tensors of at most
    TINY_CHUNKS_MAX_ELEMS elements only, as every chunk of a split tensor holds a 2 KiB partial record."""
    if chunk_elems >= 256:
        return list(mixed)
    return [name for name, t in mixed.items() if t.numel() <= TINY_CHUNKS_MAX_ELEMS]


@pytest.mark.parametrize("chunk_elems", CHUNK_SIZES)
def test_chunk_sizes_give_the_reference_records(cpu_backend, mixed, mixed_reference, records_match, chunk_elems):
    # Chunks of 7 split the tensors into short chunks merged in order; 256/257 straddle short and long chunks.
    names = for_chunks_of(chunk_elems, mixed)
    report = nanscan.scan({name: mixed[name] for name in names}, backend=backends.CpuBackend(chunk_elems=chunk_elems))
    rows = [list(mixed).index(name) for name in names]
    records_match(report.records, mixed_reference[rows], names, label=f"cpu backend, chunks of {chunk_elems}")


@pytest.mark.parametrize("chunk_elems", [7, 257, L.DEFAULT_CHUNK_ELEMS])
def test_records_do_not_depend_on_the_thread_count(cpu_backend, mixed, chunk_elems):
    tensors = {name: mixed[name] for name in for_chunks_of(chunk_elems, mixed)}
    one = nanscan.scan(tensors, backend=backends.CpuBackend(chunk_elems=chunk_elems, num_threads=1)).records
    two = nanscan.scan(tensors, backend=backends.CpuBackend(chunk_elems=chunk_elems, num_threads=2)).records
    np.testing.assert_array_equal(one, two)  # the float64 sum of squares included


def test_short_path_records_equal_the_block_path_bit_for_bit(cpu_backend, mixed):
    """A tensor and the same tensor padded with zeros to BLOCK_PATH_ELEMS elements: the first is scanned by the
    short-chunk path, the second by the block path, and the zeros change only the zero count. Even the sum of
    squares must keep every bit, which holds only if the short path adds the squares in the block path's order
    (element order would change the last bits of most of these sums)."""
    short = {name: t for name, t in mixed.items() if t.numel() < BLOCK_PATH_ELEMS}
    padded = {name: torch.cat([t, torch.zeros(BLOCK_PATH_ELEMS - t.numel(), dtype=t.dtype)])
              for name, t in short.items()}
    got = nanscan.scan(short, backend=backends.CpuBackend()).records
    want = nanscan.scan(padded, backend=backends.CpuBackend()).records.copy()
    want[:, L.REC_ZERO] -= [BLOCK_PATH_ELEMS - t.numel() for t in short.values()]
    for i in np.flatnonzero((got != want).any(axis=1))[:1]:
        slots = np.flatnonzero(got[i] != want[i]).tolist()
        pytest.fail(f"{list(short)[i]!r}: record slots {slots[:8]} differ from the block path's "
                    f"({got[i, slots[:4]].tolist()} vs {want[i, slots[:4]].tolist()})")


def demo_training_tensors() -> dict[str, torch.Tensor]:
    """The demo model's parameters, its gradients and its AdamW state after one step: what Monitor.check scans."""
    config = dict(D.DEFAULT_CONFIG)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
        optimizer = D.build_optimizer(model, config)
        tokens = torch.randint(0, config["vocab_size"], (config["batch_size"], config["seq_len"] + 1))
        batch = {"tokens": tokens, "weights": torch.rand(config["batch_size"], config["seq_len"])}
        D.step_fn(model, batch).backward()
        optimizer.step()
    tensors = {}
    for name, p in model.named_parameters():
        tensors[f"param:{name}"] = p.detach()
        tensors[f"grad:{name}"] = p.grad
        for key, value in optimizer.state[p].items():
            tensors[f"optim:{name}.{key}"] = value
    return tensors


def test_a_demo_model_training_set_matches_the_reference(cpu_backend, records_match):
    tensors = demo_training_tensors()
    sizes = [t.numel() for t in tensors.values()]
    # What makes the set worth testing here: Adam's one-element step counters and many other short tensors.
    assert sizes.count(1) == sum(name.endswith(".step") for name in tensors) > 0
    assert sum(s <= 256 for s in sizes) > len(sizes) // 2
    reference = nanscan.scan(tensors, backend="reference").records
    one = nanscan.scan(tensors, backend=backends.CpuBackend(num_threads=1))
    records_match(one.records, reference, one.names, label="cpu backend on the demo model's training state")
    two = nanscan.scan(tensors, backend=backends.CpuBackend(num_threads=2))
    np.testing.assert_array_equal(one.records, two.records)
    assert one.ok
