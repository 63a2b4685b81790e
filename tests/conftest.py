"""Shared fixtures: every scanning backend as a parametrized axis, each checked against the reference backend.

`backend_under_test` yields "cpu", "numba" and "cuda" in turn and skips, saying why, the ones that cannot run here,
except that a built nanscan._C must give a working cpu backend (a broken build must fail, not skip). The modules that
`make test`'s numba pass leaves out are marked `once` here (tests/two_passes.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import nanscan
from nanscan.engine import _layout as L
from nanscan.engine import backends
from two_passes import NATIVE_PASS_ONLY

BACKENDS_UNDER_TEST = ("cpu", "numba", "cuda", "numba-cuda")

# The suite checks the nanscan._torch_access that `make` builds beside the package: one built at first use (NOTE:
# [first-use build] in nanscan/engine/torch_access_build.py) would stand in for a missing one unnoticed, and be built
# again for a test that pretends to run another torch. tests/test_install.py checks that build on its own.
os.environ["NANSCAN_BUILD_TORCH_ACCESS"] = "0"

# Every slot but the sum of squares is an exact integer (counts, bit patterns, bins) and must match exactly.
EXACT_SLOTS = np.array([k for k in range(L.RECORD_WIDTH) if k != L.REC_SUMSQ])
_SLOT_NAMES = {L.REC_NAN: "nan", L.REC_POSINF: "posinf", L.REC_NEGINF: "neginf", L.REC_ZERO: "zero",
               L.REC_SUBNORMAL: "subnormal", L.REC_ABSMAX_BITS: "absmax_bits", L.REC_ABSMIN_BITS: "absmin_bits"}

# The sum of squares is the one float64 accumulation, and backends add in different orders (chunks, vector lanes,
# torch's pairwise sum). Squares of float16/bfloat16/float32 values are exact in float64 and every term is
# non-negative, so there is no cancellation: orders differ by rounding alone, about sqrt(n) * 2**-53 relative for
# n terms (n <= ~10**5 here, so ~1e-14), far inside 1e-12, while any dropped or doubled element shows.
SUMSQ_REL_TOL = 1e-12


def native_extension_expected() -> bool:
    """True when a compiled nanscan._C is present: then it must import, and the cpu backend must work."""
    return importlib.util.find_spec("nanscan._C") is not None


@pytest.fixture(scope="session")
def native():
    """nanscan._C; a build that exists but does not import fails the test instead of skipping it."""
    try:
        from nanscan import _C
    except ImportError as exc:
        if native_extension_expected():
            pytest.fail(f"nanscan._C is built but does not import: {exc}")
        pytest.skip(f"nanscan._C is not built here: {exc}")
    return _C


def slot_name(slot: int) -> str:
    if slot == L.REC_FINGERPRINT:
        return "fingerprint"
    if slot >= L.REC_HIST:
        return f"hist[2**{slot - L.REC_HIST + L.MIN_BIN_EXPONENT}]"
    return _SLOT_NAMES.get(slot, str(slot))


def sumsq_of(record: np.ndarray) -> float:
    return float(record[L.REC_SUMSQ:L.REC_SUMSQ + 1].view(np.float64)[0])


def assert_records_match(got: np.ndarray, want: np.ndarray, names, *, label: str = "backend") -> None:
    """Records equal slot by slot (`==`), except the sum of squares, equal within SUMSQ_REL_TOL."""
    assert got.shape == want.shape, f"{label}: records of shape {got.shape}, reference {want.shape}"
    for i, name in enumerate(names):
        diff = EXACT_SLOTS[got[i, EXACT_SLOTS] != want[i, EXACT_SLOTS]]
        assert not len(diff), (
            f"{label} disagrees with the reference on {name!r}: "
            + ", ".join(f"{slot_name(k)}={got[i, k]} (reference {want[i, k]})" for k in diff[:8]))
        got_sumsq, want_sumsq = sumsq_of(got[i]), sumsq_of(want[i])
        if math.isfinite(want_sumsq):
            ok = math.isclose(got_sumsq, want_sumsq, rel_tol=SUMSQ_REL_TOL, abs_tol=0.0)
        else:  # overflowed squares (float64 values above 2**512) make it +inf in every backend
            ok = got_sumsq == want_sumsq
        assert ok, f"{label}: sum of squares of {name!r} is {got_sumsq!r}, reference {want_sumsq!r}"


@dataclass(frozen=True)
class BackendUnderTest:
    """One backend to check, on the device it scans; `create` builds a fresh instance, optionally with chunks so
    small that every tensor longer than a few elements is split across chunks."""

    name: str
    device: torch.device

    def create(self, *, tiny_chunks: bool = False):
        if self.name == "cpu":
            return backends.CpuBackend(chunk_elems=7) if tiny_chunks else backends.CpuBackend()
        if self.name == "numba":
            from nanscan.engine.backends.numba_cpu import NumbaBackend

            return NumbaBackend(chunk_elems=5) if tiny_chunks else NumbaBackend()
        if self.name == "cuda":
            from nanscan.engine.backends.cuda import CudaBackend

            return CudaBackend(chunk_bytes=16) if tiny_chunks else CudaBackend()
        if self.name == "numba-cuda":
            from nanscan.engine.backends.numba_cuda import NumbaCudaBackend

            return NumbaCudaBackend(threads=32, blocks=2, piece_elems=7) if tiny_chunks else NumbaCudaBackend()
        raise ValueError(f"no backend under test called {self.name!r}")

    def check(self, tensors, *, tiny_chunks: bool = False) -> nanscan.ScanReport:
        """Scan `tensors` (already on self.device) with this backend and with the reference; assert they agree."""
        report = nanscan.scan(tensors, backend=self.create(tiny_chunks=tiny_chunks))
        reference = nanscan.scan(tensors, backend="reference")
        assert report.names == reference.names
        assert report.backend == self.name
        label = f"{self.name} backend" + (" with tiny chunks" if tiny_chunks else "")
        assert_records_match(report.records, reference.records, report.names, label=label)
        return report


def backend_or_skip(name: str) -> BackendUnderTest:
    """The named backend, ready to check; skips, saying why, when it cannot run here."""
    try:
        backends.load(name)
    except backends.BackendUnavailable as exc:
        if name == "cpu" and native_extension_expected():
            pytest.fail(f"nanscan._C is built but the cpu backend does not load: {exc}")
        pytest.skip(f"the {name} backend cannot run here: {exc}")
    return BackendUnderTest(name, torch.device("cuda" if name in ("cuda", "numba-cuda") else "cpu"))


@pytest.fixture(scope="session",
                params=[pytest.param(name, marks=[pytest.mark.cuda] if "cuda" in name else []) for name in
                        BACKENDS_UNDER_TEST])
def backend_under_test(request) -> BackendUnderTest:
    return backend_or_skip(request.param)


@pytest.fixture(scope="session")
def cpu_backend() -> BackendUnderTest:
    return backend_or_skip("cpu")


@pytest.fixture(scope="session")
def numba_backend() -> BackendUnderTest:
    return backend_or_skip("numba")


@pytest.fixture
def clean_backend_state(monkeypatch):
    """Empty the backend module's load cache and announcements for one test, restored afterwards."""
    monkeypatch.setattr(backends, "_loaded", {})
    monkeypatch.setattr(backends, "_load_errors", {})
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    return backends


# -- bit-pattern tables -------------------------------------------------------------------------------------------

# The float8 formats, each a torch dtype and its nanscan dtype code.
FLOAT8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


class BitTables:
    """Raw bit patterns of the values every classification must get right, per format, and tensors made of them."""

    FIELDS = {torch.float16: (5, 10), torch.bfloat16: (8, 7), torch.float32: (8, 23), torch.float64: (11, 52),
              torch.float8_e4m3fn: (4, 3), torch.float8_e5m2: (5, 2), torch.float8_e4m3fnuz: (4, 3),
              torch.float8_e5m2fnuz: (5, 2)}
    _INT_TYPES = {torch.float16: (np.uint16, np.int16), torch.bfloat16: (np.uint16, np.int16),
                  torch.float32: (np.uint32, np.int32), torch.float64: (np.uint64, np.int64),
                  **{dtype: (np.uint8, np.uint8) for dtype in FLOAT8_DTYPES}}

    @staticmethod
    def tensor(bits, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `dtype` holding exactly these bit patterns (no value ever passes through a float)."""
        unsigned, signed = BitTables._INT_TYPES[dtype]
        return torch.from_numpy(np.asarray(bits, dtype=unsigned).view(signed).copy()).view(dtype)

    @staticmethod
    def bits_of(t: torch.Tensor) -> np.ndarray:
        unsigned, signed = BitTables._INT_TYPES[t.dtype]
        return t.detach().cpu().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                                   8: torch.int64}[t.element_size()]).numpy().view(unsigned)

    @staticmethod
    def all_patterns(dtype: torch.dtype) -> torch.Tensor:
        """Every 16-bit pattern (8-bit for the float8 formats) once, in order."""
        if dtype.itemsize == 1:
            return torch.arange(1 << 8, dtype=torch.int32).to(torch.uint8).view(dtype)
        return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)

    @staticmethod
    def special(dtype: torch.dtype) -> dict[str, int]:
        """Signed zeros, subnormal and normal extremes, infinities, quiet and signalling NaNs with payloads."""
        exp_bits, mant_bits = BitTables.FIELDS[dtype]
        sign = 1 << (exp_bits + mant_bits)
        exp_max = (1 << exp_bits) - 1
        mant_max = (1 << mant_bits) - 1
        quiet = 1 << (mant_bits - 1)
        inf = exp_max << mant_bits
        bias = (1 << (exp_bits - 1)) - 1
        positive = {
            "0": 0,
            "smallest subnormal": 1,
            "middle subnormal": 1 << (mant_bits // 2),
            "largest subnormal": mant_max,
            "smallest normal": 1 << mant_bits,
            "smallest normal + 1ulp": (1 << mant_bits) | 1,
            "one": bias << mant_bits,
            "one - 1ulp": (bias << mant_bits) - 1,
            "largest normal": inf - 1,
            "inf": inf,
            "quiet NaN": inf | quiet,
            "quiet NaN with payload 1": inf | quiet | 1,
            "quiet NaN with all payload bits": inf | mant_max,
            "signalling NaN with payload 1": inf | 1,
            "signalling NaN with the largest payload": inf | (quiet - 1),
        }
        table = {}
        for label, bits in positive.items():
            table[f"+{label}"] = bits
            table[f"-{label}"] = sign | bits
        return table

    @staticmethod
    def powers_of_two(dtype: torch.dtype) -> np.ndarray:
        """Every power of two of the format (subnormal ones too) with its neighbours one ulp either side, both
        signs: every binade boundary, the normal/subnormal boundary and the histogram's clamped end bins."""
        exp_bits, mant_bits = BitTables.FIELDS[dtype]
        bias = (1 << (exp_bits - 1)) - 1
        sign = 1 << (exp_bits + mant_bits)
        inf = ((1 << exp_bits) - 1) << mant_bits
        smallest = 1 - bias - mant_bits
        patterns = set()
        for k in range(smallest, bias + 1):
            bits = (k + bias) << mant_bits if k >= 1 - bias else 1 << (k - smallest)
            for b in (bits - 1, bits, bits + 1):
                if 0 < b < inf:
                    patterns.update((b, sign | b))
        return np.array(sorted(patterns), dtype=BitTables._INT_TYPES[dtype][0])


@pytest.fixture(scope="session")
def bit_tables() -> type[BitTables]:
    return BitTables


@pytest.fixture(scope="session")
def records_match():
    """assert_records_match(got, want, names, label=...), for tests that compare records themselves."""
    return assert_records_match


def default_backend_name() -> str:
    """What `backend=None` must pick for CPU tensors here: NANSCAN_BACKEND when set, else the best that loads."""
    requested = backends.requested_name(None)
    if requested is not None:
        return requested
    for name in backends.AUTO_ORDER["cpu"]:
        try:
            backends.load(name)
            return name
        except backends.BackendUnavailable:
            continue
    raise AssertionError("not even the reference backend loads")


@pytest.fixture(scope="session")
def expected_default_backend() -> str:
    name = default_backend_name()
    if native_extension_expected() and backends.requested_name(None) is None:
        assert name == "cpu", "nanscan._C is built, so auto selection must choose the cpu backend"
    return name


def pytest_collection_modifyitems(config, items):
    """Marks the tests of two_passes.NATIVE_PASS_ONLY's modules `once` (NOTE: [two passes] in tests/two_passes.py):
    `make test`'s numba pass deselects them."""
    for item in items:
        if item.path.stem in NATIVE_PASS_ONLY:
            item.add_marker(pytest.mark.once)
