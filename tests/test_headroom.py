"""nanscan.headroom on hand-built exponent histograms: binades that overflow, turn subnormal or flush to zero in
float16, bfloat16 and the float8 formats, and an end-to-end case from a real scan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nanscan
from nanscan import _layout as L


def hist_of(*binades: int, count: int = 1) -> np.ndarray:
    """A 256-bin exponent histogram with `count` values in each given binade (floor(log2|x|))."""
    hist = np.zeros(L.HIST_BINS, dtype=np.int64)
    for binade in binades:
        hist[binade - L.MIN_BIN_EXPONENT] += count
    return hist


def by_format(hist) -> dict:
    return {h.format: h for h in nanscan.headroom(hist)}


def test_formats_reported():
    assert list(by_format(hist_of(0))) == ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]


def test_two_to_the_16_overflows_float16_but_not_bfloat16():
    result = by_format(hist_of(16))
    assert result["float16"].overflow == 1.0
    assert result["bfloat16"].overflow == 0.0
    assert result["float16"].binades_to_overflow == -1
    assert result["bfloat16"].binades_to_overflow == 127 - 16


def test_float16_top_binade_counts_as_fitting():
    # 2**15 <= x < 2**16 holds float16's largest finite value 65504; binade granularity counts all of it as fitting.
    assert by_format(hist_of(15))["float16"].overflow == 0.0
    assert by_format(hist_of(15))["float16"].binades_to_overflow == 0


def test_float16_subnormal_and_underflow_boundaries():
    assert by_format(hist_of(-25))["float16"].underflow == 1.0  # below 2**-24, the smallest subnormal
    assert by_format(hist_of(-25))["float16"].subnormal == 0.0
    assert by_format(hist_of(-24))["float16"].subnormal == 1.0  # the smallest subnormal itself
    assert by_format(hist_of(-20))["float16"].subnormal == 1.0
    assert by_format(hist_of(-20))["float16"].underflow == 0.0
    assert by_format(hist_of(-15))["float16"].subnormal == 1.0
    assert by_format(hist_of(-14))["float16"].subnormal == 0.0  # the smallest normal
    assert by_format(hist_of(-20))["bfloat16"].subnormal == 0.0


@pytest.mark.parametrize("binade, overflow, subnormal, underflow", [
    (9, 1.0, 0.0, 0.0),    # 512 > 448, the largest e4m3fn value
    (8, 0.0, 0.0, 0.0),    # 256 <= x < 512 holds 448
    (-6, 0.0, 0.0, 0.0),   # the smallest normal
    (-7, 0.0, 1.0, 0.0),
    (-9, 0.0, 1.0, 0.0),   # the smallest subnormal, 2**-9
    (-10, 0.0, 0.0, 1.0),
])
def test_float8_e4m3fn_boundaries(binade, overflow, subnormal, underflow):
    h = by_format(hist_of(binade))["float8_e4m3fn"]
    assert (h.overflow, h.subnormal, h.underflow) == (overflow, subnormal, underflow)


@pytest.mark.parametrize("binade, overflow, subnormal, underflow", [
    (16, 1.0, 0.0, 0.0),
    (15, 0.0, 0.0, 0.0),    # holds 57344, the largest e5m2 value
    (-14, 0.0, 0.0, 0.0),
    (-15, 0.0, 1.0, 0.0),
    (-16, 0.0, 1.0, 0.0),   # the smallest subnormal
    (-17, 0.0, 0.0, 1.0),
])
def test_float8_e5m2_boundaries(binade, overflow, subnormal, underflow):
    h = by_format(hist_of(binade))["float8_e5m2"]
    assert (h.overflow, h.subnormal, h.underflow) == (overflow, subnormal, underflow)


def test_fractions_of_a_mixed_histogram():
    hist = hist_of(0, count=6) + hist_of(16, count=1) + hist_of(-20, count=2) + hist_of(-30, count=1)
    h = by_format(hist)["float16"]
    assert h.values == 10
    assert (h.overflow, h.subnormal, h.underflow) == (0.1, 0.2, 0.1)
    assert h.top_binade == 16
    b = by_format(hist)["bfloat16"]
    assert (b.overflow, b.subnormal, b.underflow) == (0.0, 0.0, 0.0)


def test_bfloat16_below_the_clamped_end_bin_is_subnormal_not_underflow():
    # Bin 0 holds every value below 2**-127, so bfloat16's subnormal/zero split there cannot be resolved.
    h = by_format(hist_of(L.MIN_BIN_EXPONENT, count=4))["bfloat16"]
    assert (h.subnormal, h.underflow) == (1.0, 0.0)


def test_empty_histogram():
    for h in nanscan.headroom(np.zeros(L.HIST_BINS, dtype=np.int64)):
        assert (h.values, h.overflow, h.subnormal, h.underflow) == (0, 0.0, 0.0, 0.0)
        assert h.top_binade is None and h.binades_to_overflow is None


@pytest.mark.parametrize("bad", [np.zeros(255), np.zeros((2, 256)), np.zeros(0), 7])
def test_wrong_shape_raises(bad):
    with pytest.raises(ValueError, match="exp_hist must have 256 bins"):
        nanscan.headroom(bad)


def test_from_a_real_scan():
    x = torch.tensor([2.0 ** 16, 3.0 * 2.0 ** 16, 1.0, 2.0 ** -20, 0.0, float("nan")])
    stats = nanscan.scan({"x": x})["x"]
    h = by_format(stats.exp_hist)
    assert h["float16"].values == 4  # zeros and NaN are counted, not binned
    assert (h["float16"].overflow, h["float16"].subnormal) == (0.5, 0.25)
    assert h["bfloat16"].overflow == 0.0 and h["float16"].top_binade == 17
    assert h["float16"].to_dict()["format"] == "float16"
