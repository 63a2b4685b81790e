"""classify.h, the per-element classification every kernel (CPU and GPU) runs, against the reference definitions.

nanscan._C.classify_bits runs the header's own code element by element; the reference here states each definition
with torch's float operations instead of bits (isnan/isinf, comparisons with the smallest normal, frexp), as
nanscan/_reference.py does. Exhaustive for the 16-bit formats, tables and hypothesis for float32/float64.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FLOAT8_DTYPES
from nanscan.engine import _layout as L

try:
    from nanscan import _C
except ImportError as exc:
    if importlib.util.find_spec("nanscan._C") is not None:
        raise ImportError(f"nanscan._C is built but does not import: {exc}") from exc
    pytest.skip("nanscan._C is not built here (no C++ compiler at install time); the numba and reference backends "
                "are checked by test_agreement.py", allow_module_level=True)

CODES = {torch.float16: L.FLOAT16, torch.bfloat16: L.BFLOAT16, torch.float32: L.FLOAT32, torch.float64: L.FLOAT64,
         **{dtype: L.DTYPE_CODES[str(dtype).removeprefix("torch.")] for dtype in FLOAT8_DTYPES}}


def reference_classes_and_bins(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(value class, histogram bin or -1) per element, from float64 values (exact for every supported format)."""
    x = t.to(torch.float64)
    a = x.abs()
    classes = torch.full(x.shape, L.NORMAL, dtype=torch.int32)
    classes[a < torch.finfo(t.dtype).tiny] = L.SUBNORMAL
    classes[a == 0] = L.ZERO
    classes[torch.isposinf(x)] = L.POSINF
    classes[torch.isneginf(x)] = L.NEGINF
    classes[torch.isnan(x)] = L.NAN
    _, exponent = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): floor(log2 a) = e - 1
    bins = (exponent.to(torch.int64) - 1).clamp(L.MIN_BIN_EXPONENT, L.MAX_BIN_EXPONENT) - L.MIN_BIN_EXPONENT
    binned = (classes == L.NORMAL) | (classes == L.SUBNORMAL)
    bins = torch.where(binned, bins, torch.full_like(bins, -1))
    return classes.numpy(), bins.to(torch.int32).numpy()


def assert_header_matches_reference(t: torch.Tensor, bit_tables) -> None:
    bits = bit_tables.bits_of(t)
    classes, bins = _C.classify_bits(bits.astype(np.uint64), CODES[t.dtype])
    want_classes, want_bins = reference_classes_and_bins(t)
    for got, want, what in ((classes, want_classes, "class"), (bins, want_bins, "bin")):
        wrong = np.flatnonzero(got != want)
        assert not len(wrong), (
            f"classify.h gives the wrong {what} for {len(wrong)} {t.dtype} patterns, e.g. "
            + ", ".join(f"{int(bits[i]):#x}: {got[i]} (reference {want[i]})" for i in wrong[:6]))


def test_layout_constants_match_the_extension():
    info = _C.build_info()
    assert info["record_width"] == L.RECORD_WIDTH
    assert info["hist_bins"] == L.HIST_BINS
    assert info["min_bin_exponent"] == L.MIN_BIN_EXPONENT
    assert info["dtype_codes"] == L.DTYPE_CODES
    assert info["formats"] == {code: dataclasses.asdict(traits) for code, traits in L.FORMATS.items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern(dtype, bit_tables):
    t = bit_tables.all_patterns(dtype)
    assert_header_matches_reference(t, bit_tables)
    classes, _ = _C.classify_bits(bit_tables.bits_of(t).astype(np.uint64), CODES[dtype])
    exp_bits, mant_bits = bit_tables.FIELDS[dtype]
    # Each class's share of the 2**16 patterns follows from the field widths alone.
    expected = {L.NAN: 2 * ((1 << mant_bits) - 1), L.POSINF: 1, L.NEGINF: 1, L.ZERO: 2,
                L.SUBNORMAL: 2 * ((1 << mant_bits) - 1), L.NORMAL: 2 * ((1 << exp_bits) - 2) << mant_bits}
    assert sum(expected.values()) == 1 << 16
    assert {c: int((classes == c).sum()) for c in expected} == expected


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_every_float8_pattern(dtype, bit_tables):
    t = bit_tables.all_patterns(dtype)
    assert_header_matches_reference(t, bit_tables)
    classes, bins = _C.classify_bits(bit_tables.bits_of(t).astype(np.uint64), CODES[dtype])
    # Spelled out (NOTE: [float8 specials]): where each format's NaNs and infinities are, and its largest normal.
    nan = {torch.float8_e4m3fn: [0x7F, 0xFF], torch.float8_e5m2: [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF],
           torch.float8_e4m3fnuz: [0x80], torch.float8_e5m2fnuz: [0x80]}[dtype]
    assert np.flatnonzero(classes == L.NAN).tolist() == nan
    assert np.flatnonzero(classes == L.POSINF).tolist() == ([0x7C] if dtype == torch.float8_e5m2 else [])
    assert np.flatnonzero(classes == L.NEGINF).tolist() == ([0xFC] if dtype == torch.float8_e5m2 else [])
    assert np.flatnonzero(classes == L.ZERO).tolist() == ([0] if "fnuz" in str(dtype) else [0, 0x80])
    largest = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B, torch.float8_e4m3fnuz: 0x7F,
               torch.float8_e5m2fnuz: 0x7F}[dtype]
    assert classes[largest] == L.NORMAL and bins[largest] == int(np.log2(torch.finfo(dtype).max)) - L.MIN_BIN_EXPONENT


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_special_values(dtype, bit_tables):
    table = bit_tables.special(dtype)
    t = bit_tables.tensor(list(table.values()), dtype)
    assert_header_matches_reference(t, bit_tables)
    classes, bins = _C.classify_bits(bit_tables.bits_of(t).astype(np.uint64), CODES[dtype])
    by_label = dict(zip(table, zip(classes.tolist(), bins.tolist())))
    # Spelled out for the values whose class is easiest to get wrong.
    assert by_label["-0"] == (L.ZERO, -1)
    assert by_label["+inf"] == (L.POSINF, -1) and by_label["-inf"] == (L.NEGINF, -1)
    for label in ("quiet NaN", "signalling NaN with payload 1", "quiet NaN with all payload bits"):
        assert by_label[f"+{label}"] == (L.NAN, -1) and by_label[f"-{label}"] == (L.NAN, -1)
    assert by_label["+largest subnormal"][0] == L.SUBNORMAL
    assert by_label["+smallest normal"][0] == L.NORMAL
    assert by_label["-one"] == (L.NORMAL, 0 - L.MIN_BIN_EXPONENT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_powers_of_two_and_their_neighbours(dtype, bit_tables):
    t = bit_tables.tensor(bit_tables.powers_of_two(dtype), dtype)
    assert_header_matches_reference(t, bit_tables)


def test_bins_clamp_at_both_ends(bit_tables):
    # float64 reaches far past the histogram's [2**-128, 2**127] range: the end bins take everything beyond.
    values = torch.tensor([2.0 ** -1074, 2.0 ** -129, 2.0 ** -128, 2.0 ** -127, 2.0 ** 126, 2.0 ** 127, 2.0 ** 1023],
                          dtype=torch.float64)
    _, bins = _C.classify_bits(bit_tables.bits_of(values).astype(np.uint64), L.FLOAT64)
    assert bins.tolist() == [0, 0, 0, 1, 254, 255, 255]


def test_unknown_dtype_code_is_rejected():
    unknown = len(L.DTYPE_NAMES)  # the next code, not yet given to a format
    with pytest.raises(ValueError, match=f"unknown dtype code {unknown}"):
        _C.classify_bits(np.zeros(1, np.uint64), unknown)


def bit_patterns(exp_bits: int, mant_bits: int):
    """Patterns built from sign, exponent field and mantissa, each often at an edge (0, 1, max-1, max), so that
    zeros, subnormals, infinities and NaNs come up far more often than among uniform random bits."""
    field_max = (1 << exp_bits) - 1
    mant_max = (1 << mant_bits) - 1
    fields = st.one_of(st.sampled_from([0, 1, 2, field_max - 1, field_max]), st.integers(0, field_max))
    mantissas = st.one_of(st.sampled_from([0, 1, 1 << (mant_bits - 1), mant_max]), st.integers(0, mant_max))
    built = st.builds(lambda s, f, m: (s << (exp_bits + mant_bits)) | (f << mant_bits) | m,
                      st.integers(0, 1), fields, mantissas)
    return st.lists(st.one_of(built, st.integers(0, (1 << (1 + exp_bits + mant_bits)) - 1)), min_size=1, max_size=200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_random_patterns(dtype, data, bit_tables):
    exp_bits, mant_bits = bit_tables.FIELDS[dtype]
    patterns = data.draw(bit_patterns(exp_bits, mant_bits))
    assert_header_matches_reference(bit_tables.tensor(patterns, dtype), bit_tables)
